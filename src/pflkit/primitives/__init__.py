"""Primitives below the algorithm contract: the local-SGD loop, gradient hooks, the proximal
loss and the optimiser settings (training), weighted sums and interpolations of weight dicts
(tree), BatchNorm keys (bn). They import nothing of pflkit's: the contract
(:mod:`pflkit.algorithms.base`, ``env``, ``context``) and the engine are built on them, and
``tests/test_structure.py`` keeps them below."""
