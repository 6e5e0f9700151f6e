"""Side-by-side benchmarks of autobatch and the batch-size finders users would pick instead.

Outside the package; needs the ``bench`` extra. Run ``python -m benchmarks.run``.
"""
