"""Rollout samplers: one class per ``conf/sampler/<name>.yaml`` (its ``_target_``), on the interface
:class:`stepflow.samplers.base.Sampler`. The math they bind is :mod:`stepflow.math.sde` (and :mod:`stepflow.math.solvers`)."""

from stepflow.samplers.base import Sampler
from stepflow.samplers.cps import Cps
from stepflow.samplers.dance_sde import DanceSde
from stepflow.samplers.ddim_sde import DdimSde
from stepflow.samplers.dpm2 import Dpm2
from stepflow.samplers.flow_sde import FlowSde
from stepflow.samplers.ode import Ode

__all__ = ["Sampler", "FlowSde", "DanceSde", "DdimSde", "Cps", "Ode", "Dpm2"]
