"""Turn scripts shipped with `ladle bench voice` (the format: ladle.bench.voice_script); data only."""
