"""The demo's task in Python: addition problems in the demo model's character vocabulary (`moetrain grpo`'s
built-in task, rl/tasks/addition.h), for loops written against the low-level calls.

A problem is (prompt ids "<bos>A+B=", answer ids: the sum's digits least-significant first, then <eos>, text).
Training problems never include a held-out pair.
"""
from __future__ import annotations

from ._moetrain import _AdditionTask, _task_start

__all__ = ["Addition", "task_start"]


class Addition:
    def __init__(self, lo: int = 1, hi: int = 3, longest: bool = False, seed: int = 0):
        self._t = _AdditionTask(int(lo), int(hi), bool(longest), int(seed))
        self.hi = int(hi)

    def train(self, count: int) -> list:
        """`count` training problems drawn from this task's generator."""
        return self._t.train(int(count))

    def eval(self, n: int, seed: int = 7) -> list:
        """n distinct held-out problems (the same for the same seed)."""
        return self._t.eval(int(n), int(seed))

    @staticmethod
    def exact(answer, tokens) -> float:
        """1.0 when the response is the answer (digits, then <eos>), else 0.0: `moetrain grpo`'s exact reward."""
        return 1.0 if list(map(int, tokens)) == list(answer) else 0.0


def task_start(name: str = "sharpen", device: str = "auto") -> str:
    """The model directory `moetrain grpo --task NAME` starts from (made when absent, as the command does)."""
    return _task_start(name, device)
