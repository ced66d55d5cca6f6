"""Testing support shipped with meshfuse: a pytest plugin for multi-device tests.

The plugin (:mod:`meshfuse.testing.plugin`, the ``meshfuse`` pytest11 entry point) gives tests
the ``multidevice_test`` fixture (a :class:`~meshfuse.testing.fixture.MultideviceTest`) and runs
every test marked ``mpi`` or using that fixture with real torch.distributed processes, at world
sizes 1, 2 and 4 by default, from one plain ``pytest``; under ``torchrun`` or ``mpirun`` the
launcher's processes run them. This package does not import the plugin, so that importing it
does not register anything.
"""

from meshfuse.testing.fixture import MultideviceTest

__all__ = ["MultideviceTest"]
