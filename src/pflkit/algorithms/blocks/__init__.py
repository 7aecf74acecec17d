"""Building blocks above the algorithm contract, shared by several algorithms: restricted
softmax (rs), the inherited private model (hpm), soft-prediction distillation (distill), the
common initial model and the shared-body algorithm (split). They import the contract
(:mod:`pflkit.algorithms.base`); the primitives below it live in :mod:`pflkit.primitives`."""
