"""Breaks of client-level DP (pflkit.privacy): the noise, the clipping, the accountant (filed
under fedavg, whose run they break) and the release map (under fedper and ditto)."""

from mutate import Break

T = "tests/test_client_dp.py"
NOISE = (f"{T}::test_noise_std_is_z_times_c_on_the_sum",)
CLIP = (
    f"{T}::test_central_clips_each_update_and_divides_the_sum_by_the_cohort",
    f"{T}::test_the_norm_is_taken_over_every_released_tensor_together",
    f"{T}::test_clipping_and_noise_std_equal_flowers_fixed_clipping_wrapper",
)
ACCOUNT = (
    f"{T}::test_epsilon_equals_dp_accountings_round_by_round",
    f"{T}::test_every_row_reports_the_epsilon_of_the_rounds_so_far",
)
F = "privacy/client_dp.py"

BREAKS = [
    Break(
        "fedavg",
        "noise not added",
        F,
        "noised = {k: (t + noise(t, sigma, gen)) / self.cohort",
        "noised = {k: (t + 0 * noise(t, sigma, gen)) / self.cohort",
        NOISE,
    ),
    Break(
        "fedavg",
        "local noise not added",
        F,
        "cid: {k: t + noise(t, sigma, gen) for k, t in d.items()}",
        "cid: {k: t + 0 * noise(t, sigma, gen) for k, t in d.items()}",
        NOISE,
    ),
    Break(
        "fedavg",
        "no clipping",
        F,
        "deltas[cid] = {k: t * scale for k, t in d.items()}",
        "deltas[cid] = dict(d)",
        CLIP,
    ),
    Break(
        "fedavg",
        "clip after the sum",
        F,
        "total = {k: sum(d[k] for d in deltas.values()) for k in first}",
        "unclipped_d = {c: {k: t / min(1.0, C / max(math.sqrt(sum(float(u.double().pow(2).sum()) for u in d.values())), 1e-12)) for k, t in d.items()} for c, d in deltas.items()}; total = {k: sum(d[k] for d in unclipped_d.values()) for k in first}; tn = math.sqrt(sum(float(t.double().pow(2).sum()) for t in total.values())); total = {k: t * min(1.0, C / tn) for k, t in total.items()}",
        CLIP,
    ),
    Break(
        "fedavg",
        "norm per tensor, not over the whole update",
        F,
        "norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in d.values()))",
        "norm = max(float(t.double().norm()) for t in d.values())",
        CLIP,
    ),
    Break(
        "fedavg",
        "the mean over the received uploads, not the cohort",
        F,
        "for k, t in total.items()}",
        "for k, t in total.items()}; noised = {k: t * self.cohort / len(deltas) for k, t in noised.items()}",
        (f"{T}::test_a_client_that_drops_out_keeps_the_fixed_denominator",),
    ),
    Break(
        "fedavg",
        "sample weights kept",
        F,
        'out["num_samples"] = 1',
        'out["num_samples"] = out["num_samples"]',
        (f"{T}::test_central_clips_each_update_and_divides_the_sum_by_the_cohort",),
    ),
    Break(
        "fedavg",
        "accountant steps off by one",
        "privacy/accountant.py",
        "return dp_accounting.SelfComposedDpEvent(one, rounds)",
        "return dp_accounting.SelfComposedDpEvent(one, rounds + 1)",
        ACCOUNT,
    ),
    Break(
        "fedavg",
        "accountant ignores the sampling rate",
        "privacy/accountant.py",
        "one = gauss if sampling_rate >= 1 else",
        "one = gauss if True else",
        ACCOUNT,
    ),
    Break(
        "fedper",
        "FedRep/FedPer upload the private head",
        "algorithms/blocks/split.py",
        'upload = {"body": {k: w[k] for k in self.shared_keys(model)}',
        'upload = {"body": {k: w[k] for k in w}',
        (
            "tests/test_conformance.py::test_uploads_follow_the_release_map_and_never_carry_a_private_part",
        ),
    ),
    Break(
        "ditto",
        "Ditto uploads its personal model",
        "algorithms/ditto.py",
        "return Update(glob.upload, {**state",
        'return Update({**glob.upload, "weights": personal}, {**state',
        (
            "tests/test_conformance.py::test_uploads_follow_the_release_map_and_never_carry_a_private_part",
        ),
    ),
]
