"""Sim stage: step cost models and a simulated clock driving the real core/.

`pagellm simulate` runs the engine's own Scheduler and KVCacheManager (pagellm/core/)
against a workload, with a cost model predicting each step's duration in place of the
model runner. Nothing here imports torch except the calibration sweep, which measures
the real engine (calibration_sweep.py).
"""
