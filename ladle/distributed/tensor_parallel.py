"""Tensor (and expert) parallel ranks: worker processes that each compute a shard of the model.

The engine's process is rank 0, the driver: its scheduler decides every step, and each model
call it makes (forward, logits, a KV copy) is broadcast to the workers first, which make the
same call on their shards; the forward's all-reduces and all-to-alls then join the ranks.
Commands go over one gloo group that waits as long as the engine idles, the forward's
collectives over another with a short timeout. `mp` starts the workers as local processes,
`ray` as actors on a Ray cluster (ladle.distributed.ray_ranks). A worker that dies is noticed
(its process or actor ends, or a collective fails) and turns every later call into
WorkerDiedError, which the server reports as an unhealthy engine.
"""

from __future__ import annotations

import functools
import io
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path

import torch

from ladle.distributed.processes import die_with_parent, free_port
from ladle.model.attention import KVCache, TorchPagedAttention
from ladle.model.collectives import ProcessGroupComm
from ladle.model.config import ModelConfig
from ladle.model.llama import LlamaForCausalLM
from ladle.model.registry import causal_lm_class
from ladle.model.sharding import Shard

log = logging.getLogger("ladle")

COLLECTIVE_TIMEOUT = timedelta(seconds=120)  # ranks run in lockstep: a longer wait means one is stuck
IDLE_TIMEOUT = timedelta(days=365)  # workers wait for the next command as long as the engine idles


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker is gone; the engine cannot compute any more."""


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard."""

    folder: str
    cfg: ModelConfig
    dtype: torch.dtype
    quantization: str
    num_blocks: int
    block_size: int
    kv_dtype: torch.dtype
    world: int
    expert_parallel: bool
    num_threads: int
    backend: str = "mp"  # how ranks 1..world-1 start: "mp" (local processes) or "ray"
    host: str = "127.0.0.1"  # where rank 0 hosts the TCP store: set by WorkerGroup
    port: int = 0


def build_rank_model(spec: RankSpec, rank: int, comm: ProcessGroupComm,
                     weights: dict | None = None) -> tuple[LlamaForCausalLM, KVCache]:
    """This rank's shard of the model and its KV cache (its KV heads only)."""
    from ladle.model.loader import load_weights

    shard = Shard(rank, spec.world, spec.expert_parallel)
    shard.check(spec.cfg)
    local = shard.local_config(spec.cfg)
    kv = KVCache(local.num_kv_layers, spec.num_blocks, spec.block_size, local.num_key_value_heads,
                 local.head_dim, dtype=spec.kv_dtype, layer_shapes=local.cache_layer_shapes)
    backend = TorchPagedAttention(kv, local.num_attention_heads, local.num_key_value_heads, local.head_dim,
                                  local.layer_windows, local.attention_scale)
    if weights is None:
        weights = load_weights(Path(spec.folder), spec.dtype)
    return causal_lm_class(spec.cfg)(spec.cfg, weights, backend, spec.quantization, shard, comm), kv


def _groups(spec: RankSpec, rank: int) -> tuple[object, object, object]:
    """(compute group, command group, their TCP store, which rank 0 hosts)."""
    store = torch.distributed.TCPStore(spec.host, spec.port, spec.world, is_master=rank == 0,
                                       timeout=timedelta(seconds=300))
    compute = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("compute", store), rank, spec.world,
                                                 COLLECTIVE_TIMEOUT)
    commands = torch.distributed.ProcessGroupGloo(torch.distributed.PrefixStore("commands", store), rank,
                                                  spec.world, IDLE_TIMEOUT)
    return compute, commands, store


def _broadcast(group: object, payload: bytes | None) -> bytes:
    """Rank 0's payload on every rank (rank 0 passes it, the others None)."""
    size = torch.tensor([0 if payload is None else len(payload)], dtype=torch.int64)
    group.broadcast(size, 0).wait()
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload is not None \
        else torch.empty(int(size), dtype=torch.uint8)
    group.broadcast(data, 0).wait()
    return payload if payload is not None else data.numpy().tobytes()


def worker_main(spec: RankSpec, rank: int) -> None:
    """A worker process: build the shard, then run the driver's commands until told to stop."""
    die_with_parent(signal.SIGKILL)  # the driver's rank is gone: nothing is left to compute
    torch.set_num_threads(spec.num_threads)
    compute, commands, _store = _groups(spec, rank)
    model, kv = build_rank_model(spec, rank, ProcessGroupComm(compute))
    _broadcast(commands, None)  # the driver's "start": everyone is built
    while True:
        op, args = pickle.loads(_broadcast(commands, None))
        if op == "forward":
            model.forward(*args)
        elif op == "logits":
            model.compute_logits(*args)
        elif op == "copy_prefix":
            kv.copy_prefix(*args)
        elif op == "stop":
            return


class LocalRanks:
    """`mp`: ranks 1..world-1 as processes on this machine, dying with it."""

    host = "127.0.0.1"

    def start(self, spec: RankSpec) -> None:
        # fresh interpreters (not multiprocessing's spawn, which would re-run the user's main script)
        self.procs = [subprocess.Popen([sys.executable, "-m", "ladle.distributed.tensor_parallel"],
                                       stdin=subprocess.PIPE,
                                       preexec_fn=functools.partial(die_with_parent, signal.SIGKILL))
                      for _ in range(1, spec.world)]
        for rank, p in enumerate(self.procs, start=1):
            p.stdin.write(pickle.dumps((spec, rank)))
            p.stdin.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def wait(self, rank: int) -> str:
        """Blocks until the rank's process ends; how it ended."""
        proc = self.procs[rank - 1]
        return f"(pid {proc.pid}) exited with code {proc.wait()}"

    def settle(self, timeout: float) -> None:
        """Gives ranks that are dying the time to end (so the failure names how)."""
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass

    def stop(self, timeout: float) -> None:
        """Waits for ranks told to stop; kills the ones that do not."""
        for p in self.procs:
            try:
                p.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                p.kill()


def _start_ranks(backend: str):
    if backend == "ray":
        from ladle.distributed.ray_ranks import RayRanks

        return RayRanks()
    return LocalRanks()


class WorkerGroup:
    """The driver's side: starts ranks 1..world-1 and sends them its commands."""

    def __init__(self, spec: RankSpec):
        self.failure: str | None = None
        self._closed = False
        self.ranks = _start_ranks(spec.backend)
        self.spec = spec = replace(spec, host=self.ranks.host, port=free_port(self.ranks.host))
        self.ranks.start(spec)
        for rank in range(1, spec.world):
            threading.Thread(target=self._watch, args=(rank,), name=f"ladle-tp{rank}-watch", daemon=True).start()
        self.compute, self.commands, self._store = _groups(spec, 0)
        self.comm = ProcessGroupComm(self.compute)

    def started(self) -> None:
        """Waits until every worker has built its shard."""
        self._guard(lambda: _broadcast(self.commands, b"start"))

    def _watch(self, rank: int) -> None:
        how = self.ranks.wait(rank)
        if not self._closed:
            self.failure = f"tensor-parallel worker rank {rank} {how}"
            log.error("%s; the engine cannot compute any more", self.failure)

    def _guard(self, fn):
        if self.failure is not None:
            raise WorkerDiedError(self.failure)
        try:
            return fn()
        except RuntimeError as e:  # a collective failed: most likely a worker died under it
            self.ranks.settle(timeout=2.0)
            self.failure = self.failure or f"a tensor-parallel collective failed: {e}"
            raise WorkerDiedError(self.failure) from e

    def call(self, op: str, *args) -> None:
        """Sends the command; the driver then runs the same call on its own shard."""
        payload = io.BytesIO()
        pickle.dump((op, args), payload, protocol=pickle.HIGHEST_PROTOCOL)
        self._guard(lambda: _broadcast(self.commands, payload.getvalue()))

    def run(self, fn):
        """The driver's own part of a call, failures reported as WorkerDiedError."""
        return self._guard(fn)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.failure is None:
            try:
                self.call("stop")
            except WorkerDiedError:
                pass
        self.ranks.stop(timeout=5.0)


class ParallelModel:
    """The driver's model: every call is sent to the workers, then made on the driver's shard."""

    def __init__(self, local: LlamaForCausalLM, workers: WorkerGroup):
        self.local, self.workers = local, workers

    def forward(self, input_ids, positions, meta, keep=None, num_layers=None, lora=None):
        self.workers.call("forward", input_ids, positions, meta, None, num_layers)
        return self.workers.run(lambda: self.local.forward(input_ids, positions, meta, keep, num_layers, lora))

    def compute_logits(self, hidden: torch.Tensor, batch_invariant: bool = False) -> torch.Tensor:
        self.workers.call("logits", hidden, batch_invariant)
        return self.workers.run(lambda: self.local.compute_logits(hidden, batch_invariant))

    def __getattr__(self, name: str):  # cfg, routing, linears, moe_blocks, ...
        return getattr(self.local, name)


def start_parallel_model(spec: RankSpec, weights: dict) -> tuple[ParallelModel, KVCache, WorkerGroup]:
    """Starts the workers and builds the driver's shard (rank 0) from `weights`."""
    workers = WorkerGroup(spec)
    try:
        local, kv = build_rank_model(spec, 0, workers.comm, weights)
        workers.started()
    except BaseException:
        workers.close()
        raise
    log.info("tensor parallel: %d ranks on %s (%s), %s", spec.world, spec.backend,
             "experts spread over ranks" if spec.expert_parallel else "every expert split",
             f"{spec.num_threads} thread(s) each, pid {os.getpid()} is rank 0")
    return ParallelModel(local, workers), kv, workers


if __name__ == "__main__":  # a worker, started by WorkerGroup: its RankSpec and rank come on stdin
    logging.basicConfig(level=logging.WARNING)
    worker_main(*pickle.loads(sys.stdin.buffer.read()))
