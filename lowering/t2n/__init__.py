"""torch-to-nnef and tract plumbing: what the lowering needs to get a program through
torch-to-nnef 0.24.12 into tract 0.23.9, each workaround documented next to its code.

program.py (a traceable module), traced_sizes.py (symbolic sizes that stay symbolic),
dynamic_axes.py (refusing axes a program cannot follow), fixes.py (rewrites of what
torch-to-nnef or tract take wrong), bridge.py (fused nodes as torch-to-nnef extension ops),
plugin.py (their handlers), offline_target.py (a tract target that never downloads).
"""
