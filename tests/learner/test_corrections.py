"""The off-policy corrections against loops over tokens and sequences, as their papers write them."""

import math

import pytest
import torch
from pydantic import ValidationError

from learner import corrections
from learner.corrections import CORRECTIONS, Correction, Kind, register_correction
from learner.losses import policy_loss
from pipeline.config.schema import LearnerConfig

CLIP, DUAL, CAP, FLOOR = 0.2, 3.0, 1.5, 0.7


def inputs(seed: int, rows: int = 5, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(rows, width, generator=g, dtype=torch.float64) * 3
    behaviour = logp - (
        torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5
    )  # w in [0.6, 1.6]
    proximal = logp + (torch.rand(rows, width, generator=g, dtype=torch.float64) - 0.5) * 0.4
    mask = (torch.rand(rows, width, generator=g) > 0.25).to(torch.float64)
    mask[:, 0] = 1
    advantages = torch.randn(rows, generator=g, dtype=torch.float64)
    return logp, behaviour, proximal, mask, advantages


def clipped(a: float, r: float) -> float:
    loss = max(-a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP))
    return min(loss, -a * DUAL) if a < 0 else loss


def loop_token_loss(logp, behaviour, proximal, mask, advantages, keep_token):
    """token-mean over kept tokens of the clipped loss with ratio pi / pi_prox."""
    total, n = 0.0, 0
    for i in range(logp.shape[0]):
        for t in range(logp.shape[1]):
            w = math.exp(proximal[i, t] - behaviour[i, t])
            if mask[i, t] and keep_token(i, t, w):
                total += clipped(float(advantages[i]), math.exp(logp[i, t] - proximal[i, t]))
                n += 1
    return total / n


@pytest.mark.parametrize("seed", range(5))
def test_icepop_drops_tokens_outside_the_band(seed):
    logp, behaviour, proximal, mask, adv = inputs(seed)
    got, stats = policy_loss(
        logp,
        behaviour,
        adv,
        mask,
        proximal_logprobs=proximal,
        clip_low=CLIP,
        clip_high=CLIP,
        dual_clip=DUAL,
        correction=Correction("icepop", {"floor": FLOOR, "cap": CAP}),
    )
    want = loop_token_loss(logp, behaviour, proximal, mask, adv, lambda i, t, w: FLOOR <= w <= CAP)
    assert float(got) == pytest.approx(want, rel=1e-9)
    assert 0 < stats["mask_drop_fraction"] < 1  # the band really cut on both sides of these inputs


@pytest.mark.parametrize("seed", range(5))
def test_seq_mask_drops_whole_sequences_by_their_geometric_mean_weight(seed):
    logp, behaviour, proximal, mask, adv = inputs(seed)
    behaviour[0] -= 2.0  # the first sequence's weights all far above the cap: it goes
    keep_seq = []
    for i in range(logp.shape[0]):
        logs = [float(proximal[i, t] - behaviour[i, t]) for t in range(logp.shape[1]) if mask[i, t]]
        keep_seq.append(FLOOR <= math.exp(sum(logs) / len(logs)) <= CAP)
    got, _ = policy_loss(
        logp,
        behaviour,
        adv,
        mask,
        proximal_logprobs=proximal,
        clip_low=CLIP,
        clip_high=CLIP,
        dual_clip=DUAL,
        correction=Correction("seq_mask", {"floor": FLOOR, "cap": CAP}),
    )
    assert not keep_seq[0] and any(keep_seq)
    want = loop_token_loss(logp, behaviour, proximal, mask, adv, lambda i, t, w: keep_seq[i])
    assert float(got) == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("seed", range(5))
def test_gspo_clips_one_length_normalised_ratio_per_sequence(seed):
    logp, behaviour, _, mask, adv = inputs(seed)
    logp.requires_grad_(True)
    got, _ = policy_loss(
        logp,
        behaviour,
        adv,
        mask,
        clip_low=CLIP,
        clip_high=CLIP,
        dual_clip=DUAL,
        ratio_level="sequence",
        agg="seq-mean-token-mean",
    )
    per_sequence = []
    for i in range(logp.shape[0]):
        logs = [
            float(logp[i, t].detach() - behaviour[i, t]) for t in range(logp.shape[1]) if mask[i, t]
        ]
        per_sequence.append(clipped(float(adv[i]), math.exp(sum(logs) / len(logs))))
    assert float(got.detach()) == pytest.approx(sum(per_sequence) / len(per_sequence), rel=1e-9)
    got.backward()
    for i in range(logp.shape[0]):  # every kept token of a sequence gets the same gradient
        grads = logp.grad[i][mask[i] > 0]
        assert torch.allclose(grads, grads[0].expand_as(grads))
        assert (logp.grad[i][mask[i] == 0] == 0).all()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"ratio": "sequence"}, "use loss_agg seq-mean-token-mean"),
        (
            {"ratio": "sequence", "loss_agg": "seq-mean-token-mean", "importance": {"type": "tis"}},
            "use importance none or seq_mask",
        ),
    ],
)
def test_combinations_that_make_no_sense_are_refused(options, message):
    with pytest.raises(ValidationError, match=message):
        LearnerConfig(**options)
    LearnerConfig(
        ratio="sequence",
        loss_agg="seq-mean-token-mean",
        importance={"type": "seq_mask", "floor": 0.8},
    )


def test_a_correction_registers_once_under_its_name_with_its_parameters(monkeypatch):
    monkeypatch.setattr(corrections, "CORRECTIONS", dict(CORRECTIONS))

    def probe(log_w, loss_mask, *, cap):
        return log_w, loss_mask

    register_correction("probe", probe, "cap")
    register_correction("dropping", probe, "cap", drops=True)
    assert corrections.CORRECTIONS["probe"] == Kind(probe, ("cap",), False)
    assert corrections.CORRECTIONS["dropping"] == Kind(probe, ("cap",), True)
    with pytest.raises(ValueError, match="correction 'tis' is registered twice"):
        register_correction("tis", probe)
    assert corrections.CORRECTIONS["tis"] == CORRECTIONS["tis"]
