"""Work spread over processes: KV handed from a prefill worker to a decode worker."""
