"""``shoal.sim``: an event-level scaling simulator of data-parallel training with shoal.

Predicts, for M nodes x G workers, one training step's time, the communication hidden behind
backward, throughput and scaling efficiency, for shoal's algorithms and for a Horovod-style
baseline, from hardware presets (:mod:`.hardware`), model descriptions (:mod:`.models`: real
EfficientNet layer shapes or a recorded timeline) and cost models of shoal's engine and
collectives (:mod:`.engine_model`, :mod:`.collectives`). ``shoal sim --calibrate`` and
``--validate`` hold it against published and measured numbers (:mod:`.calibration`).
"""

from __future__ import annotations

from .engine_model import STRATEGIES, ScalingRow, StepResult, Strategy, scaling, step_time
from .hardware import PRESETS, Hardware, Link, get_hardware
from .models import StepProfile, load_timeline, model_profile

__all__ = ["PRESETS", "STRATEGIES", "Hardware", "Link", "ScalingRow", "StepProfile",
           "StepResult", "Strategy", "get_hardware", "load_timeline", "model_profile",
           "scaling", "step_time"]
