"""How long a step will take, so that the engine can say so before a long one.

The engine sends nothing while a step runs (the busy loop owns the output socket, and a step is
one call), and its clients count silence as death after --engine-timeout (30 s). On a GPU a step
is milliseconds; on the CPU a step of a few thousand prompt tokens of a larger model, or a chunk
deep into a long context, runs for tens of seconds or minutes. So before a step the engine
estimates its time and, where that is long, sends a heartbeat announcing it
(``Heartbeat.busy_for_s``); a client counts silence from the announced end (protocol/client.py).

The estimate: the step's work in floating-point operations (each new token through the weights,
each query-key pair of attention: ``StepWork``) over the rate the engine's steps have run at,
an exponential average of work over time. Only the proportion between two steps' work has to be
right, since the rate is measured; it is a rough count (multi-head latent and linear attention,
a vision tower are counted as plain attention or not at all), which the measured rate absorbs as
far as steps are alike. Before any step was measured a low rate is assumed (PRIOR_FLOPS_PER_S),
which only delays the detection of a stuck first step. The announced time has a margin
(BUSY_MARGIN): an underestimate would count a live engine dead, an overestimate only lets a
stuck one go unnoticed for longer, and only until the engine's next message (which ends the
announced step for its clients).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from protocol.messages import HEARTBEAT_INTERVAL_S, MAX_BUSY_S

if TYPE_CHECKING:
    from engine_core.config import ModelConfig
    from engine_core.request import ScheduledRequest

# A tenth to a twentieth of what two cores' float32 matrix products reach (about 460 GFLOP/s
# measured, docs/design/cpu-backend.md; whole steps run at 100-300): low, so that the first step
# is not announced short; the first measured step replaces it.
PRIOR_FLOPS_PER_S = 20e9
# A step expected to take longer than a heartbeat's interval is announced.
LONG_STEP_S = HEARTBEAT_INTERVAL_S
BUSY_MARGIN = 2.0  # the announced time: BUSY_MARGIN x the estimate, plus BUSY_SLACK_S
BUSY_SLACK_S = 1.0
RATE_WEIGHT = 0.3  # a new step's rate in the exponential average
# A step this short says little of the rate (a decode step is mostly per-step overhead).
MIN_MEASURED_S = 0.1


@dataclass(frozen=True)
class StepWork:
    """A model's floating-point operations per new token (through its weights: attention's
    projections, the MLP or the routed experts) and per query-key pair (QK^T and PV)."""

    per_token: float
    per_pair: float

    @classmethod
    def of(cls, mc: ModelConfig) -> StepWork:
        h, layers = mc.hidden_size, mc.num_layers
        q, kv = mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
        projections = h * (2 * q + 2 * kv)
        if mc.num_experts:
            width = mc.num_experts_per_tok * mc.moe_intermediate_size
            width += mc.n_shared_experts * mc.moe_intermediate_size
            width += mc.shared_expert_intermediate_size
        else:
            width = mc.intermediate_size
        mlp = 3 * h * width
        return cls(per_token=2.0 * layers * (projections + mlp), per_pair=4.0 * layers * q)

    def of_step(self, rows: Sequence[ScheduledRequest]) -> float:
        """The step's operations: each row's new tokens, each attending to all before it."""
        tokens = pairs = 0
        for row in rows:
            new = row.num_new_tokens
            tokens += new
            pairs += new * row.start + new * (new + 1) // 2
        return self.per_token * tokens + self.per_pair * pairs


class StepClock:
    """The measured rate of the engine's steps and the time it expects a step to take."""

    def __init__(self, work: StepWork) -> None:
        self.work = work
        self.flops_per_s = PRIOR_FLOPS_PER_S
        self.measured = False

    def busy_for_s(self, flops: float) -> float:
        """The time to announce for a step of ``flops``, the margin included; 0.0 where the
        step is not expected to outlast a heartbeat's interval (nothing to announce)."""
        expected = flops / self.flops_per_s
        if expected < LONG_STEP_S:
            return 0.0
        return min(BUSY_MARGIN * expected + BUSY_SLACK_S, MAX_BUSY_S)

    def observe(self, flops: float, seconds: float) -> None:
        """A step of ``flops`` took ``seconds``."""
        if seconds < MIN_MEASURED_S or flops <= 0:
            return
        rate = flops / seconds
        if not self.measured:
            self.flops_per_s, self.measured = rate, True
        else:
            self.flops_per_s += RATE_WEIGHT * (rate - self.flops_per_s)
