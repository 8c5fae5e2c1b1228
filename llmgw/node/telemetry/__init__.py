"""Host telemetry for the node agent: CPU, memory, temperatures and power of this machine.

The readers (:mod:`.procfs`, :mod:`.hwmon`, :mod:`.rapl`) parse what Linux prints under
/proc and /sys; each takes the root directory to read under, so tests point them at
recorded trees. :class:`.host.HostSampler` puts them together into the sample the agent
sends with its heartbeat. A sensor that is not there is ``None``, never zero.
"""
