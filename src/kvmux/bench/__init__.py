"""Benchmarks: each backend measured next to the hardware baseline in the same run.

Absolute numbers on a shared machine are noise; the ratio to a baseline
measured seconds earlier on the same buffers is the figure to read.
"""
