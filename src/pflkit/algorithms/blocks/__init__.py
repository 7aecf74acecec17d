"""Building blocks shared by several algorithms: the local-SGD loop and gradient hooks
(training), restricted softmax (rs), the inherited private model (hpm), soft-prediction
distillation (distill)."""
