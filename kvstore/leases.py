"""Worker leases: who is alive, by the time of its last message. Pure Python, explicit clock."""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.protocol import StepTimeline


@dataclass
class Worker:
    """A registered compute worker (its prefill profile lives in the manager's cost-model input)."""

    worker_id: str
    registered_at: float
    last_seen: float
    device: str = ""
    pid: int = 0
    timeline: StepTimeline | None = None  # the last one its steps carried
    timeline_at: float = 0.0


class Leases:
    """A worker is alive while it sent anything within ``timeout_s``."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.workers: dict[str, Worker] = {}

    def register(self, worker: Worker) -> None:
        self.workers[worker.worker_id] = worker

    def touch(self, worker_id: str, now: float) -> bool:
        """Renews a lease; False if the worker is unknown (it must register again)."""
        worker = self.workers.get(worker_id)
        if worker is None:
            return False
        worker.last_seen = now
        return True

    def remove(self, worker_id: str) -> None:
        self.workers.pop(worker_id, None)

    def expire(self, now: float) -> list[str]:
        """Removes and returns the workers whose lease ran out."""
        dead = [w for w, info in self.workers.items() if now - info.last_seen > self.timeout_s]
        for worker_id in dead:
            del self.workers[worker_id]
        return dead
