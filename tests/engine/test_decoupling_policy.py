"""Dynamic decoupling: the per-phase choice between running the drafter workers and plain decoding."""

from __future__ import annotations

from specactor_engine.decoupled.phase import DECOUPLED, SOLO, DecouplingPolicy


def drive(policy: DecouplingPolicy, rates: dict[str, float], rounds: int, bound: float | None = None,
          solo_expected: float | None = None) -> list[str]:
    """Run the policy against arms that emit `rates[arm]` tokens per second (1 s rounds)."""
    arms = []
    for _ in range(rounds):
        arm = policy.choose(bound, solo_expected)
        policy.observe(arm, int(rates[arm]), 1.0)
        arms.append(arm)
    return arms


def letters(arms: list[str]) -> str:
    return "".join("d" if a == DECOUPLED else "s" for a in arms)


def test_decoupling_policy_explores_both_then_exploits_the_faster():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=5, warmup_rounds=0)
    assert letters(drive(policy, {DECOUPLED: 100, SOLO: 60}, 9)) == "ss" "dd" "ddddd"
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=5, warmup_rounds=0)
    assert letters(drive(policy, {DECOUPLED: 60, SOLO: 100}, 9)) == "ss" "dd" "sssss"


def test_decoupling_needs_the_margin_and_re_explores_when_things_change():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, margin=0.05, warmup_rounds=0)
    assert letters(drive(policy, {DECOUPLED: 102, SOLO: 100}, 8)) == "ss" "dd" "ssss"  # 2% better is not enough
    # the tail: the batch shrank and the drafter now pays; the next exploration finds it
    assert letters(drive(policy, {DECOUPLED: 150, SOLO: 100}, 8)) == "ss" "dd" "dddd"


def test_warmup_rounds_of_an_arm_are_not_measured():
    policy = DecouplingPolicy(explore_rounds=4, exploit_rounds=4, warmup_rounds=2)
    for _ in range(4):
        policy.observe(policy.choose(), 60, 1.0)
    # decoupled is slow for its first 2 rounds (catch-up), then fast
    for seconds in (5.0, 5.0, 1.0, 1.0):
        arm = policy.choose()
        assert arm == DECOUPLED
        policy.observe(arm, 100, seconds)
    assert policy.rate(DECOUPLED) == 100.0 and policy.rate(SOLO) == 60.0
    assert policy.choose() == DECOUPLED


def test_the_exploit_period_doubles_while_the_same_arm_keeps_winning_and_resets_on_a_change():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, max_exploit_rounds=10, warmup_rounds=0)
    arms = drive(policy, {DECOUPLED: 60, SOLO: 100}, 8 + 12 + 14)
    assert letters(arms) == "ssdd" "ssss" "ssdd" "ssssssss" "ssdd" "ssssssssss"  # 4, then 8, then capped at 10
    # the drafter starts to pay: the next exploration switches arms and the period starts over at 4
    assert letters(drive(policy, {DECOUPLED: 150, SOLO: 100}, 8)) == "ssdd" "dddd"


def test_the_workers_arm_is_not_explored_when_even_its_best_case_cannot_win():
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, warmup_rounds=0)
    # a compute-bound full batch: every draft accepted would still give 90 tokens/s against plain 100
    arms = drive(policy, {DECOUPLED: 80, SOLO: 100}, 2 + 4 + 2 + 8, bound=90.0)
    assert letters(arms) == "ss" "ssss" "ss" "ssssssss" and policy.skipped == 2
    # the batch shrank into the tail: the best case could win now, so the arm is measured again
    assert letters(drive(policy, {DECOUPLED: 150, SOLO: 100}, 2 + 2 + 4, bound=400.0)) == "ssdd" "dddd"


def test_the_workers_best_case_must_also_clear_what_the_paused_arm_is_expected_to_keep_up():
    """Trace D, session 41: the paused arm's measured rounds decoded plainly (its in-process draft model waiting to
    catch up), so its measured rate was plain decoding's; the workers' best case cleared that but not the rate the
    in-process model was expected to keep up, and the workers held the rows for 80 rounds at ~52 tokens/s against
    ~70 in process."""
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, warmup_rounds=0)
    assert letters(drive(policy, {DECOUPLED: 52, SOLO: 48}, 2)) == "ss"
    assert policy.deciding()  # the exploration of the paused arm ends: the caller computes its estimates for it
    arms = drive(policy, {DECOUPLED: 52, SOLO: 48}, 3, bound=60.0, solo_expected=70.0)
    assert letters(arms) == "sss" and policy.skipped == 1
    assert not policy.deciding()  # inside the exploit period of 4
    # without the expectation (or below the measured rate) the bound clears the measured 48 and the arm is explored
    policy = DecouplingPolicy(explore_rounds=2, exploit_rounds=4, warmup_rounds=0)
    assert letters(drive(policy, {DECOUPLED: 52, SOLO: 48}, 2 + 2, bound=60.0, solo_expected=40.0)) == "ss" "dd"


class _RecordingCoordinator:
    """Stands in for DecoupledCoordinator: records the calls, supplies no drafts (unit isolation)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.buffers = None

    def reset(self, num_slots, max_len, sampling, window, output_of) -> None:
        self.calls.append("reset")

    def pause(self, paused: bool) -> None:
        self.calls.append("pause" if paused else "resume")

    def add_rows(self, slots, keys, prompts) -> None:
        self.calls.append("add_rows")

    def poll(self) -> None:
        pass

    def take(self, slots, caps):
        import numpy as np

        return np.zeros((len(slots), int(caps.max()) if len(caps) else 0), dtype=np.int64), np.zeros(len(slots),
                                                                                                      dtype=np.int64)

    def after_round(self, slots, output, emitted) -> None:
        pass

    def remove_rows(self, slots) -> None:
        pass

    def close(self) -> None:
        pass


def test_workers_are_paused_before_the_first_rows_arrive_when_plain_decoding_is_measured_first():
    """A worker given rows while running starts prefilling them at once, on the verifier's cores, and
    would slow down the plain-decoding window the policy measures first."""
    import torch

    from specactor_engine.decoupled.launch import DrafterWorkers
    from specactor_engine.engine import Engine
    from tests.engine.test_exactness import MAX_LEN, ragged_requests, rollout, run, sampling, token_ids
    from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer

    target = make_tiny_model("llama", seed=0, dtype=torch.float64)
    coordinator = _RecordingCoordinator()
    config = rollout("decoupled", workers=True, dynamic_decoupling=True, num_draft_tokens=3, max_batch_size=8)
    engine = Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN,
                    workers=DrafterWorkers(coordinator, verifier_threads=1))
    params = sampling(1.0, max_new_tokens=12)
    result = engine.generate(ragged_requests(3), params)
    assert coordinator.calls.index("pause") < coordinator.calls.index("add_rows"), coordinator.calls
    assert result.stats.arm_rounds.get("solo", 0) > 0
    assert token_ids(result) == token_ids(run(target, ragged_requests(3), params))


def test_the_workers_best_case_reads_the_acceptance_of_the_workers_own_drafts(monkeypatch):
    """The bound on the workers' arm weighs the statistics of their drafts (the prior until a round verified any),
    not the pooled acceptance of whatever drafted in process: on trace D at round 12 that was n-gram and suffix
    drafts and their shadows, and every run explored the workers' arm for 12 rounds on 2 cores, where it ran at ~0.7x
    the paused arm's rate (session 46)."""
    import torch

    from specactor_engine import clock
    from specactor_engine.decoupled.launch import DrafterWorkers
    from specactor_engine.engine import Engine
    from specactor_engine.proposer import WORKERS
    from tests.engine.test_exactness import MAX_LEN, ragged_requests, rollout, sampling
    from tests.fixtures.tiny_models import make_tiny_model, make_tokenizer

    target = make_tiny_model("llama", seed=0, dtype=torch.float64)
    config = rollout("decoupled", workers=True, dynamic_decoupling=True, num_draft_tokens=3, max_batch_size=8,
                     verify_length="dynamic")
    engine = Engine(target, make_tokenizer(), config, max_model_len=MAX_LEN,
                    workers=DrafterWorkers(_RecordingCoordinator(), verifier_threads=1))
    params = sampling(1.0, max_new_tokens=16, ignore_eos=True)
    # a clock that stands still in every call: the bounds compared below are read at the same calibration (every width
    # alike) and realised factor (none measured); on the wall clock the workers' rounds of the call between them, if
    # the arm is explored (a race of the measured paused rate against the bound), move both
    with clock.replaced(lambda: 0.0):
        engine.generate(ragged_requests(3), params)
    policy = engine.length_policy

    def certain(stats) -> None:  # every draft accepted, over many rounds
        stats.accept_through = [1.0] * policy.max_k
        stats.long_run = [1.0] * policy.max_k
        stats.observed = [100] * policy.max_k

    bounds: list[float] = []
    original = DecouplingPolicy.choose

    def choose(self, decoupled_bound=None, solo_expected=None):
        if decoupled_bound is not None:
            bounds.append(decoupled_bound)
        return original(self, decoupled_bound, solo_expected)

    monkeypatch.setattr(DecouplingPolicy, "choose", choose)
    certain(policy.stats)  # the pooled statistics say every draft is accepted; the workers' are unobserved
    policy.by_method.pop(WORKERS, None)
    with clock.replaced(lambda: 0.0):
        engine.generate(ragged_requests(3), params)
    unobserved = bounds[0]
    certain(policy.method_stats(WORKERS))
    bounds.clear()
    with clock.replaced(lambda: 0.0):
        engine.generate(ragged_requests(3), params)
    assert bounds[0] > 1.2 * unobserved
