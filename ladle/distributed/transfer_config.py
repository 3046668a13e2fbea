"""--kv-transfer-config: a worker's role in disaggregated prefill/decode (vLLM's flag and names).

    {"kv_role": "kv_producer", "kv_ip": "127.0.0.1", "kv_port": 14579}

kv_producer: a prefill worker; it keeps the K/V of requests sent with
`kv_transfer_params: {"do_remote_decode": true}` and serves them over TCP on kv_ip:kv_port.
kv_consumer: a decode worker; a request sent with the producer's reply `kv_transfer_params`
fetches that K/V and continues from it (recomputing the prompt when it cannot).
kv_both: either. kv_buffer_size: the most bytes of K/V a producer holds for fetches not yet made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass(frozen=True)
class KVTransferConfig:
    kv_role: str
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579  # 0: any free port (tests)
    kv_buffer_size: int = 10**9
    kv_connector: str = "LadleTCPConnector"  # the only transport; named for vLLM configs that carry one

    def __post_init__(self) -> None:
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_transfer_config: kv_role must be one of {ROLES}, not {self.kv_role!r}")
        if not 0 <= self.kv_port < 65536 or self.kv_buffer_size <= 0:
            raise ValueError("kv_transfer_config: kv_port must be a port number and kv_buffer_size positive")
        if self.kv_connector not in ("LadleTCPConnector",):
            raise ValueError(f"kv_transfer_config: ladle transfers K/V with LadleTCPConnector, not {self.kv_connector!r}")

    @property
    def produces(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumes(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig") -> "KVTransferConfig":
        if isinstance(value, KVTransferConfig):
            return value
        obj = json.loads(value) if isinstance(value, str) else dict(value)
        if not isinstance(obj, dict):
            raise ValueError("--kv-transfer-config takes a JSON object")
        unknown = set(obj) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown field(s) {sorted(unknown)}")
        return cls(**obj)
