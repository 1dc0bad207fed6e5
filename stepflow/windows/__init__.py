"""SDE windows: one class per ``conf/window/<name>.yaml`` (its ``_target_``), on the interface
:class:`stepflow.windows.base.Window`. MixGRPO's released position arithmetic is :mod:`stepflow.math.window`."""

from stepflow.windows.base import Window
from stepflow.windows.fixed import Fixed
from stepflow.windows.mixgrpo import MixGrpo
from stepflow.windows.none import NoWindow
from stepflow.windows.random import Random
from stepflow.windows.random_start import RandomStart
from stepflow.windows.sliding import Sliding

__all__ = ["Window", "NoWindow", "Fixed", "Sliding", "Random", "RandomStart", "MixGrpo"]
