"""``stepflow.sde``: the sampler math's import path before the package took its folders (now
:mod:`stepflow.math.sde`), kept for code written against it (``from stepflow.sde import SamplerConfig,
time_grid``). Every public name of :mod:`stepflow.math.sde` is here; new code imports that module."""

from stepflow.math.sde import *  # noqa: F403 - the whole public surface, by design
from stepflow.math.sde import SAMPLERS, SamplerConfig  # noqa: F401 - named for readers and linters
