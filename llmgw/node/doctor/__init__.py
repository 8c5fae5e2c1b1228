"""``llmgw doctor``: what a node is, what is wrong with it and how to fix it, most serious first.

:func:`~llmgw.node.doctor.gather.gather` reads the machine into
:class:`~llmgw.node.doctor.checks.NodeFacts`; :func:`~llmgw.node.doctor.checks.diagnose` turns
them into a :class:`~llmgw.node.doctor.report.Report` of findings. ``llmgw agent join`` runs it
on a new node.
"""
