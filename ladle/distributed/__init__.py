"""Work spread over processes: tensor-parallel ranks, and KV handed from a prefill worker to a decode worker."""
