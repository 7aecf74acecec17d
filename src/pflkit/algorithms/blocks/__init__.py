"""Building blocks shared by several algorithms: the local-SGD loop, gradient hooks and the
proximal loss (training), restricted softmax (rs), the inherited private model (hpm),
soft-prediction distillation (distill), BatchNorm keys (bn), the common initial model and the
shared-body algorithm (split), weighted sums and interpolations of weight dicts (tree)."""
