"""What one pipeline rank does, as data: compute actions and the sends and receives between
stages.

An :class:`Action` names its kind, the (global) stage and the microbatch. It prints compactly
(``F1.3`` is the forward of stage 1 on microbatch 3) and :func:`parse` reads that text back,
so golden tests can state a schedule as text. The kinds:

- ``F``: forward; ``B``: the whole backward (input and weight gradients together);
- ``I``: the input-gradient half of the backward; ``W``: the weight-gradient half, which a
  zero-bubble schedule defers to fill idle time;
- ``SF``/``RF``: send the stage's output to the next stage / receive the stage's input from
  the previous one; ``SB``/``RB``: send the gradient of the stage's input to the previous
  stage / receive the gradient of the stage's output from the next one.
"""

from __future__ import annotations

import dataclasses
import re

from meshfuse.errors import ScheduleError

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
SEND_FORWARD, RECV_FORWARD, SEND_BACKWARD, RECV_BACKWARD = "SF", "RF", "SB", "RB"
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
COMMUNICATION = (SEND_FORWARD, RECV_FORWARD, SEND_BACKWARD, RECV_BACKWARD)
SENDS = {SEND_FORWARD: RECV_FORWARD, SEND_BACKWARD: RECV_BACKWARD}
_TEXT = re.compile(r"^(SF|RF|SB|RB|F|B|I|W)(\d+)\.(\d+)$")


@dataclasses.dataclass(frozen=True, order=True)
class Action:
    """One step of a rank's schedule: ``kind`` (see the module's list) of ``stage`` on
    ``microbatch``."""

    kind: str
    stage: int
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in COMPUTE + COMMUNICATION:
            raise ScheduleError(f"unknown pipeline action kind {self.kind!r}; use one of "
                                f"{', '.join(COMPUTE + COMMUNICATION)}")

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE

    @property
    def is_backward(self) -> bool:
        """True for the actions that produce the gradient of the stage's input (B and I)."""
        return self.kind in (BACKWARD, BACKWARD_INPUT)


def F(stage: int, microbatch: int) -> Action:
    return Action(FORWARD, stage, microbatch)


def B(stage: int, microbatch: int) -> Action:
    return Action(BACKWARD, stage, microbatch)


def I(stage: int, microbatch: int) -> Action:
    return Action(BACKWARD_INPUT, stage, microbatch)


def W(stage: int, microbatch: int) -> Action:
    return Action(BACKWARD_WEIGHT, stage, microbatch)


def parse(text: str) -> list[Action]:
    """The actions of a space-separated text such as ``"F0.0 F0.1 B0.0"``."""
    actions = []
    for word in text.split():
        match = _TEXT.match(word)
        if match is None:
            raise ScheduleError(f"cannot read pipeline action {word!r}; write kind, stage, "
                                f"'.', microbatch, e.g. 'F1.3' or 'SB2.0'")
        actions.append(Action(match[1], int(match[2]), int(match[3])))
    return actions


def text(actions) -> str:
    """The actions as one line of text, the inverse of :func:`parse`."""
    return " ".join(str(a) for a in actions)
