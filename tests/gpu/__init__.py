"""GPU tests (marked cuda): run on the device machine by benchmarks/gpu_check.sh."""
