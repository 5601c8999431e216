"""``kvmux bench serve``: does disaggregation bound tail ITL on this machine?

Colocated serving (two instances, chunked prefill) against 1P1D through kvmux
on the same cores, under Poisson arrivals of long prompts and long outputs.
Modules, in the order a run uses them: :mod:`~kvmux.bench.serve.workload`
(what is sent, when), :mod:`~kvmux.bench.serve.topology` (what serves it),
:mod:`~kvmux.bench.serve.load` (the client), :mod:`~kvmux.bench.serve.metrics`
(the figures), :mod:`~kvmux.bench.serve.crosscheck` (vLLM's benchmark on one
point), :mod:`~kvmux.bench.serve.report` and :mod:`~kvmux.bench.serve.plots`
(the outputs), :mod:`~kvmux.bench.serve.run` (all of it).
"""
