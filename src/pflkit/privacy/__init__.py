"""Differential privacy (docs/privacy.md): client-level DP of the uploads
(:mod:`pflkit.privacy.client_dp`, DP-FedAvg with a dp-accounting accountant,
:mod:`pflkit.privacy.accountant`) and sample-level DP-SGD in local training through Opacus
(:mod:`pflkit.privacy.dpsgd`)."""
