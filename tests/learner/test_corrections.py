"""The off-policy corrections against loops over tokens and sequences, as their papers write them."""

import math

import pytest
import torch
from pydantic import ValidationError

from learner import corrections
from learner.corrections import CORRECTIONS, Correction, Kind, register_correction
from learner.losses import policy_loss
from pipeline.config.algorithm import IMPORTANCE
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


def loop_correction(name: str, w: list[list[float]], floor: float, cap: float):
    """(multiplier, kept) of each correction on an all-ones mask, one token or row at a time."""
    multiplier = [[min(x, cap) if name == "tis" else 1.0 for x in row] for row in w]
    kept = []
    for row in w:
        geo = math.exp(sum(math.log(x) for x in row) / len(row))
        for x in row:
            if name == "mask":
                keep = x <= cap
            elif name == "icepop":
                keep = floor <= x <= cap
            else:
                keep = name != "seq_mask" or floor <= geo <= cap
            kept.append(float(keep))
    return multiplier, [kept[i : i + len(w[0])] for i in range(0, len(kept), len(w[0]))]


@pytest.mark.parametrize("section", IMPORTANCE)
def test_a_correction_without_parameters_acts_as_its_config_sections_defaults(section):
    """Correction(name) alone takes the function's defaults: the section's (floor 0.5, cap 2.0),
    with weights on both sides of each and of the neighbours a wrong default would have."""
    name = section.model_fields["type"].default
    w = [[0.3, 0.7, 1.0, 1.7, 2.5, 3.5], [0.7] * 6, [2.5] * 6, [1.2] * 6, [0.4] * 6]
    log_w = torch.tensor(w, dtype=torch.float64).log()
    mask = torch.ones_like(log_w)
    multiplier, kept = Correction(name).apply(log_w, mask)
    from_config = Correction.from_section(section()).apply(log_w, mask)
    want_multiplier, want_kept = loop_correction(name, w, floor=0.5, cap=2.0)
    torch.testing.assert_close(multiplier, torch.tensor(want_multiplier, dtype=torch.float64))
    assert kept.tolist() == want_kept
    torch.testing.assert_close(from_config[0], multiplier)
    torch.testing.assert_close(from_config[1], kept)
    # a section away from the defaults: from_section carries its values
    chosen = {k: v for k, v in {"floor": 0.8, "cap": 1.5}.items() if k in section.model_fields}
    multiplier, kept = Correction.from_section(section(**chosen)).apply(log_w, mask)
    want_multiplier, want_kept = loop_correction(name, w, floor=0.8, cap=1.5)
    torch.testing.assert_close(multiplier, torch.tensor(want_multiplier, dtype=torch.float64))
    assert kept.tolist() == want_kept


def edges() -> tuple[float, float]:
    """A floor and a cap that are exactly the weights exp(-0.3) and exp(0.4) as torch computes
    them: the test reads the comparison at the edge, not a rounding."""
    floor = float(torch.tensor(-0.3, dtype=torch.float64).exp())
    return floor, float(torch.tensor(0.4, dtype=torch.float64).exp())


@pytest.mark.parametrize("name", ["mask", "icepop"])
def test_a_token_weighing_exactly_the_floor_or_the_cap_is_kept(name):
    floor, cap = edges()
    log_w = torch.tensor([[-0.3, 0.4, -0.31, 0.41]], dtype=torch.float64)
    params = {"cap": cap} if name == "mask" else {"floor": floor, "cap": cap}
    multiplier, kept = Correction(name, params).apply(log_w, torch.ones_like(log_w))
    assert multiplier.tolist() == [[1.0] * 4]
    assert kept.tolist() == [[1.0, 1.0, 1.0, 0.0] if name == "mask" else [1.0, 1.0, 0.0, 0.0]]


def test_seq_mask_keeps_a_mean_weight_exactly_at_the_floor_or_the_cap_and_means_one_token_alone():
    floor, cap = edges()
    log_w = torch.tensor(
        [[-0.3, -0.3, 9.0], [0.4, 0.4, 9.0], [0.6, 9.0, 9.0], [0.0, 0.1, 0.2]], dtype=torch.float64
    )  # the 9s are masked out: they must not count
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.float64)
    _, kept = Correction("seq_mask", {"floor": floor, "cap": cap}).apply(log_w, mask)
    # row 2: one token of weight exp(0.6) = 1.82, over the cap 1.49 (halved, it would pass)
    assert kept.tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 0], [1, 1, 1]]


def test_an_unknown_correction_or_parameter_is_refused_naming_what_there_is():
    with pytest.raises(
        ValueError, match=r"^unknown importance correction 'bogus': use none, tis, mask, icepop, "
    ):
        Correction("bogus")
    with pytest.raises(ValueError, match=r"^correction none takes no parameters, not cap$"):
        Correction("none", {"cap": 2.0})
    with pytest.raises(ValueError, match=r"^correction icepop takes floor, cap, not ceiling, top$"):
        Correction("icepop", {"top": 1.0, "ceiling": 2.0})
