"""The token oracle (`sim.checks.token_divergence`): a request's sampled tokens against running
it alone, found and reported from one computation of the reference."""

from types import SimpleNamespace

import sim.checks
from sim.checks import WrongToken, first_wrong_token, reference_tokens, token_divergence


def _world(outputs: dict[int, list[int]], vocab: int = 97):
    requests = {rid: SimpleNamespace(prompt=(rid + 1, 2, 3), max_tokens=6, stop_token_ids=())
                for rid in outputs}
    ctrl = SimpleNamespace(finished=set(outputs), outputs=outputs, requests=requests)
    return SimpleNamespace(ctrl=ctrl, scenario=SimpleNamespace(vocab=vocab))


def _alone(rid: int, vocab: int = 97) -> list[int]:
    return reference_tokens(SimpleNamespace(prompt=(rid + 1, 2, 3), max_tokens=6,
                                            stop_token_ids=()), vocab)


def test_first_wrong_token_names_the_request_index_and_both_token_lists():
    wrong = _alone(1)
    wrong[2] = (wrong[2] + 1) % 97
    world = _world({0: _alone(0), 1: wrong})
    assert first_wrong_token(world) == WrongToken(1, 2, wrong, _alone(1))
    assert first_wrong_token(_world({0: _alone(0), 1: _alone(1)})) is None


def test_outputs_that_end_early_are_wrong_where_they_end():
    assert first_wrong_token(_world({0: _alone(0)[:4]})) == WrongToken(0, 4, _alone(0)[:4],
                                                                       _alone(0))


def test_token_divergence_computes_each_reference_once(monkeypatch):
    """It recomputed the diverging request's reference after `first_wrong_token` had."""
    wrong = _alone(1)
    wrong[3] = (wrong[3] + 1) % 97
    world = _world({0: _alone(0), 1: wrong})
    asked = []

    def counted(request, vocab):
        asked.append(request.prompt)
        return reference_tokens(request, vocab)

    monkeypatch.setattr(sim.checks, "reference_tokens", counted)
    outcome = token_divergence(world)
    assert outcome.verdict == "divergence" and outcome.check == "tokens"
    assert outcome.detail == (f"request 1 diverged at output token 3: sampled {wrong[3:6]}, "
                              f"running alone gives {_alone(1)[3:6]}")
    assert asked == [(1, 2, 3), (2, 2, 3)]  # request 0, then request 1: once each
