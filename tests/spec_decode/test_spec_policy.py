"""The speculation policy: proposal length from acceptance and the measured position cost."""

from pagellm.config import SpeculativeConfig
from pagellm.request import Request
from pagellm.sampling_params import SamplingParams
from pagellm.spec_decode.policy import PRIOR_RATIO, AcceptanceEstimate, StepCost, best_num_tokens
from pagellm.spec_decode.speculator import NgramSpeculator


def test_best_num_tokens_trades_acceptance_against_position_cost():
    # Free positions: propose all that may be accepted.
    assert best_num_tokens(0.5, 0.0, 4) == 4
    # Expensive positions (a 2-core CPU: ~0.4 of a step each) need likely acceptance.
    assert best_num_tokens(0.3, 0.4, 4) == 0
    assert best_num_tokens(0.95, 0.4, 4) == 4
    k_mid = best_num_tokens(0.75, 0.4, 8)
    assert 0 < k_mid < 8
    # The chosen k is the argmax of expected tokens per cost, by brute force.
    for acceptance in (0.2, 0.5, 0.7, 0.9):
        for ratio in (0.01, 0.2, 0.5):
            rates = [sum(acceptance**i for i in range(k + 1)) / (1 + ratio * k) for k in range(6)]
            assert best_num_tokens(acceptance, ratio, 5) == max(range(6), key=lambda k: (rates[k], -k))
    assert best_num_tokens(1.0, 0.4, 0) == 0


def test_acceptance_estimate_follows_recent_verifications():
    estimate = AcceptanceEstimate()
    prior = estimate.rate
    for _ in range(10):
        estimate.update(0, was_rejected=True)  # proposals rejected at once
    assert estimate.rate < 0.1 < prior
    for _ in range(10):
        estimate.update(4, was_rejected=False)  # whole proposals accepted
    assert estimate.rate > 0.9


def test_step_cost_fits_the_cost_of_a_position():
    cost = StepCost()
    assert cost.ratio == PRIOR_RATIO  # nothing measured
    for _ in range(20):
        cost.observe(1, 0.004)
    assert cost.ratio == PRIOR_RATIO  # one size only: the slope is unknown
    for positions in (1, 3, 5, 2, 4) * 8:
        cost.observe(positions, 0.003 + 0.001 * positions)  # 1 ms a position, 4 ms a step of one
    assert abs(cost.ratio - 0.25) < 1e-6
    cost.observe(500, 1.0)  # a prefill step: not decode-sized, left out
    assert abs(cost.ratio - 0.25) < 1e-6


def _request(tokens: list[int], max_tokens: int = 100) -> Request:
    return Request("r", tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens), eos_token_ids=frozenset())


def test_a_request_whose_proposals_fail_stops_proposing_and_starts_again_on_a_match():
    speculator = NgramSpeculator(SpeculativeConfig(num_speculative_tokens=4), max_model_len=1000)
    for _ in range(10):
        speculator.observe_step(1, 0.004)
        speculator.observe_step(5, 0.008)  # a position costs 1/3 of a one-position step
    request = _request([1, 2, 3, 4, 5, 6, 1, 2, 3])
    first = speculator.propose(request)  # optimistic start: as the prior acceptance makes worth it
    assert first == [4, 5, 6, 1][: len(first)] and len(first) >= 2
    for _ in range(6):
        speculator.record(request, 4, 0)
    assert speculator.propose(request) == []  # poor recent acceptance: not worth a position
    # The unverified proposal [4, 5, 6, 1] is checked against what the request produces.
    for token in (4, 5, 6, 1, 2, 3):
        request.append_output_token_ids(token)
        speculator.propose(request)
    assert speculator.propose(request), "matches seen while not proposing bring speculation back"
    speculator.finished("r")
    assert speculator._requests == {}


def test_a_draft_speculator_proposes_placeholders_and_probes_after_declining():
    from pagellm.core.scheduler_output import DRAFT_PLACEHOLDER
    from pagellm.spec_decode.speculator import DRAFT_PROBE_INTERVAL, DraftModelSpeculator

    config = SpeculativeConfig(method="draft_model", model="/draft", num_speculative_tokens=3)
    speculator = DraftModelSpeculator(config, max_model_len=1000)
    request = _request([1, 2, 3], max_tokens=3)
    # Room: max_tokens 3, nothing produced yet: at most 2 proposals (never past max_tokens).
    assert speculator.propose(request) == [DRAFT_PLACEHOLDER] * 2
    request = _request([1, 2, 3])
    for _ in range(10):
        speculator.observe_step(1, 0.004)
        speculator.observe_step(4, 0.010)  # a position costs half a step
        speculator.record(request, 3, 0)
    declined = [speculator.propose(request) for _ in range(DRAFT_PROBE_INTERVAL)]
    assert declined[:-1] == [[]] * (DRAFT_PROBE_INTERVAL - 1)
    assert declined[-1] == [DRAFT_PLACEHOLDER]  # a one-token probe keeps measuring
