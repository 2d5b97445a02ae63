"""mgk.swap_attention puts any attention kind into an existing model: softmax keeps the pretrained model's outputs,
every kind trains, and what cannot be carried over is refused in one line."""
import copy
import warnings

import pytest
import torch
from torch import nn

import mgk
from mgk import swap as swap_module

E, H = 16, 4
KINDS = mgk.attention_kinds()
VARIANTS = [(k, {}) for k in KINDS] + [("mgk", {"pi": "hard_e"}), ("mgk", {"pi": "soft_e", "max_len": 16})]


class TinyViT(nn.Module):
    """Patches -> linear embedding, class token, positions, nn.TransformerEncoder (pre-LN, batch_first), head."""

    def __init__(self, patch=4, patches=6, classes=3):
        super().__init__()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "enable_nested_tensor is True, but self.use_nested_tensor is False"
            self.encoder = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True, norm_first=True), 2)
        self.embed = nn.Linear(patch, E)
        self.cls = nn.Parameter(torch.randn(1, 1, E))
        self.pos = nn.Parameter(torch.randn(1, patches + 1, E) * 0.1)
        self.head = nn.Linear(E, classes)

    def forward(self, patches, padding=None):
        x = torch.cat([self.cls.expand(len(patches), -1, -1), self.embed(patches)], dim=1) + self.pos
        if padding is not None:
            padding = torch.cat([torch.zeros_like(padding[:, :1]), padding], dim=1)
        return self.head(self.encoder(x, src_key_padding_mask=padding)[:, 0])


def _vit_inputs():
    patches = torch.randn(3, 6, 4)
    padding = torch.zeros(3, 6, dtype=torch.bool)
    padding[1, 4:] = True
    return patches, padding


def _transformer():
    """nn.Transformer, torch's default layout (T, B, E), post-LN, with its inputs and masks."""
    model = nn.Transformer(E, H, 2, 2, 32, dropout=0.0)
    src, tgt = torch.randn(7, 3, E), torch.randn(5, 3, E)
    src_pad = torch.zeros(3, 7, dtype=torch.bool)
    src_pad[1, 5:] = True
    tgt_pad = torch.zeros(3, 5, dtype=torch.bool)
    tgt_pad[2, 4] = True
    memory_mask = torch.zeros(5, 7, dtype=torch.bool)
    memory_mask[0, 6] = memory_mask[3, :2] = True
    masks = dict(tgt_mask=nn.Transformer.generate_square_subsequent_mask(5), src_key_padding_mask=src_pad,
                 tgt_key_padding_mask=tgt_pad, memory_key_padding_mask=src_pad, memory_mask=memory_mask)
    return model, (src, tgt), masks


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_softmax_swap_keeps_a_vit_outputs(grad):
    """Eval mode, with padding; under no_grad torch's original takes its fused nested-tensor fast path."""
    torch.manual_seed(0)
    vit = TinyViT().eval()
    patches, padding = _vit_inputs()
    swapped = mgk.swap_attention(copy.deepcopy(vit), "softmax")
    assert all(type(layer.self_attn) is mgk.MultiheadAttention for layer in swapped.encoder.layers)
    with torch.set_grad_enabled(grad):
        for pad in (None, padding):
            torch.testing.assert_close(swapped(patches, pad), vit(patches, pad), rtol=0, atol=1e-6)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_softmax_swap_keeps_an_nn_transformer_outputs(grad):
    """(T, B, E) layout, causal target mask, padding of source / target / memory, and a memory mask."""
    torch.manual_seed(1)
    model, (src, tgt), masks = _transformer()
    model.eval()
    swapped = mgk.swap_attention(copy.deepcopy(model), "softmax")
    attn = swapped.decoder.layers[0].multihead_attn
    assert type(attn) is mgk.MultiheadAttention and attn.batch_first is False
    with torch.set_grad_enabled(grad):
        want, got = model(src, tgt, **masks), swapped(src, tgt, **masks)
    real = ~masks["tgt_key_padding_mask"].T
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind,options", VARIANTS, ids=[f"{k}-{o.get('pi', '')}" for k, o in VARIANTS])
def test_every_kind_trains_after_the_swap(kind, options):
    """A few Adam steps on the swapped ViT and nn.Transformer: finite losses that change; every new parameter
    gets a gradient."""
    torch.manual_seed(2)
    vit = mgk.swap_attention(TinyViT(), kind, **options)
    model, (src, tgt), masks = _transformer()
    if kind in ("linear", "mlk", "smlk"):
        masks.pop("memory_mask")  # linear attention takes padding and causal masks only
    model = mgk.swap_attention(model, kind, **options)
    patches, padding = _vit_inputs()
    labels = torch.tensor([0, 2, 1])
    params = list(vit.parameters()) + list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(vit(patches, padding), labels)
        loss = loss + model(src, tgt, **masks).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] != losses[0]
    attn = vit.encoder.layers[0].self_attn
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in attn.parameters())


def test_layout_sizes_device_dtype_and_mode_are_carried_over():
    torch.manual_seed(3)
    old = nn.MultiheadAttention(E, H, dropout=0.25, bias=False, kdim=6, vdim=5).double().train()
    new = mgk.swap_attention(old, "smgk", num_keys=3)
    assert type(new) is mgk.MGKAttention and new.keys == "shifted" and new.num_keys == 3
    assert (new.embed_dim, new.num_heads, new.head_dim, new.kdim, new.vdim) == (E, H, E // H, 6, 5)
    assert new.dropout == 0.25 and new.q_proj.bias is None and new.out_proj.bias is None
    assert new.batch_first is False and new.training and new.q_proj.weight.dtype == torch.float64
    assert new.sigma2.dtype == torch.float64


@pytest.mark.parametrize("kdim", [None, 6])
def test_softmax_swap_of_a_bare_module_with_kdim_vdim_equals_torch(kdim):
    torch.manual_seed(4)
    old = nn.MultiheadAttention(E, H, kdim=kdim, vdim=kdim and 5, batch_first=True).eval()
    new = mgk.swap_attention(old, "softmax")
    q, k, v = torch.randn(2, 3, E), torch.randn(2, 4, kdim or E), torch.randn(2, 4, (kdim and 5) or E)
    pad = torch.tensor([[False] * 4, [False, False, True, True]])
    for a, b in zip(new(q, k, v, pad), old(q, k, v, pad)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_mixture_keys_start_from_the_softmax_key_projection():
    """Separate keys: the components are the key projection plus a spread of std about KEY_SPREAD * std that sums
    to zero over them (their mean is the projection); q, v and out projections copied; pi uniform; shifted keys
    take the projection with every shift 0; the same seed gives the same module and the global RNG is left
    alone."""
    torch.manual_seed(5)
    old = nn.MultiheadAttention(E, H)
    wq, wk, wv = old.in_proj_weight.detach().chunk(3)
    state = torch.get_rng_state()
    new = mgk.swap_attention(old, "mgk", num_keys=3, seed=7)
    assert torch.equal(torch.get_rng_state(), state)
    keys = new.k_proj.weight.detach().view(3, E, E)
    torch.testing.assert_close(keys.mean(dim=0), wk, atol=1e-7, rtol=0)
    assert torch.equal(new.q_proj.weight, wq) and torch.equal(new.v_proj.weight, wv)
    assert torch.equal(new.out_proj.weight, old.out_proj.weight)
    assert torch.equal(new.k_proj.bias.detach().view(3, E)[2], old.in_proj_bias.detach()[E:2 * E])
    for r in (0, 1, 2):
        spread = (keys[r] - wk).std().item() / wk.std().item()
        assert 0.5 * swap_module.KEY_SPREAD < spread < 1.5 * swap_module.KEY_SPREAD
    assert not torch.equal(keys[1], keys[2])
    assert torch.equal(new.pi_logits, torch.zeros(H, 3))
    again = mgk.swap_attention(old, "mgk", num_keys=3, seed=7)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), new.state_dict().values()))
    shifted = mgk.swap_attention(old, "smlk")
    assert torch.equal(shifted.k_proj.weight, wk) and torch.equal(shifted.key_shift, torch.zeros(1, H, E // H))


def test_sliced_heads_keep_the_matrices_and_mgk_sources_keep_their_parameters():
    torch.manual_seed(6)
    old = mgk.MGKAttention(E, H, num_keys=2, batch_first=True)
    with torch.no_grad():
        old.pi_logits.normal_()
    two = mgk.swap_attention(old, "softmax", num_heads=2, heads="slice")
    assert two.conversion["rule"] == "slice"
    assert two.num_heads == 2 and two.head_dim == 8 and torch.equal(two.q_proj.weight, old.q_proj.weight)
    torch.testing.assert_close(two.k_proj.weight, old.k_proj.weight.view(2, E, E).mean(dim=0))  # the mean key
    hard = mgk.swap_attention(old, "mgk", pi="hard_e")
    assert torch.equal(hard.k_proj.weight, old.k_proj.weight)  # all M components
    learned = mgk.swap_attention(old, "mlk")
    assert torch.equal(learned.pi_logits, old.pi_logits)
    x = torch.randn(2, 5, E)
    torch.testing.assert_close(mgk.swap_attention(old, "mgk")(x)[0], old(x)[0], rtol=0, atol=0)


def test_a_shared_module_stays_shared_and_ours_are_swapped_too():
    shared = nn.MultiheadAttention(E, H, batch_first=True)
    model = nn.ModuleDict({"a": shared, "b": nn.Sequential(shared), "c": mgk.LinearAttention(E, H,
                                                                                              batch_first=True)})
    mgk.swap_attention(model, "smgk")
    assert model["a"] is model["b"][0] and type(model["a"]) is mgk.MGKAttention
    assert type(model["c"]) is mgk.MGKAttention


class _TwoNames(nn.Module):
    """One attention module under two names of the same parent (weight tying), and a parent shared twice."""

    def __init__(self):
        super().__init__()
        self.encoder_attn = nn.MultiheadAttention(E, H, batch_first=True)
        self.decoder_attn = self.encoder_attn
        self.first = nn.TransformerEncoderLayer(E, H, 32, dropout=0.0, batch_first=True)
        self.second = self.first
        self.blocks = nn.ModuleList([self.encoder_attn, nn.Linear(E, E), self.encoder_attn])


@pytest.mark.parametrize("kind", ["softmax", "mgk", "mlk"])
def test_every_name_of_a_module_shared_within_one_parent_gets_the_one_new_module(kind):
    model = mgk.swap_attention(_TwoNames(), kind)
    new = model.encoder_attn
    assert isinstance(new, mgk.attention.AttentionBase)
    assert model.decoder_attn is new and model.blocks[0] is new and model.blocks[2] is new
    assert model.second is model.first and isinstance(model.first.self_attn, mgk.attention.AttentionBase)
    assert not any(isinstance(m, nn.MultiheadAttention) for _, m in model.named_modules(remove_duplicate=False))


@pytest.mark.parametrize("make,match", [
    (lambda: nn.Sequential(nn.MultiheadAttention(E, H, add_bias_kv=True)), r"0 is nn.MultiheadAttention\(add_bias_kv"),
    (lambda: nn.Sequential(nn.MultiheadAttention(E, H, add_zero_attn=True)), r"add_zero_attn=True"),
    (lambda: nn.Sequential(nn.Linear(E, E)), r"holds no nn.MultiheadAttention"),
])
def test_what_cannot_be_carried_is_refused_in_one_line(make, match):
    with pytest.raises(ValueError, match=match) as err:
        mgk.swap_attention(make(), "mgk")
    assert "\n" not in str(err.value)


class _Gained(nn.MultiheadAttention):
    """A subclass with a parameter of its own (what it does with it, mgk cannot know)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gain = nn.Parameter(torch.ones(()))


class _Scaled(nn.MultiheadAttention):
    """A subclass whose own forward changes the function."""

    def forward(self, *args, **kwargs):
        out, weights = super().forward(*args, **kwargs)
        return 2 * out, weights


class _Wrapped(nn.Module):
    """A wrapper put around a projection (as LoRA-style adapters do)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


def _wrapped_out_proj():
    m = nn.MultiheadAttention(E, H)
    m.out_proj = _Wrapped(m.out_proj)
    return nn.Sequential(m)


@pytest.mark.parametrize("make,match", [
    (lambda: nn.Sequential(nn.Identity(), _Gained(E, H)), r"^swap_attention: 1 \(_Gained\) holds gain, which"),
    (lambda: nn.Sequential(_Scaled(E, H)), r"^swap_attention: 0 is _Scaled, a subclass .* with its own forward"),
    (_wrapped_out_proj, r"^swap_attention: 0.out_proj is _Wrapped, not nn.Linear"),
])
def test_torch_attention_variants_mgk_cannot_represent_are_refused_in_one_line_naming_the_module(make, match):
    """A subclass with its own parameter raised a bare KeyError('gain'), and a subclass with its own
    forward would have been replaced silently."""
    with pytest.raises(ValueError, match=match) as err:
        mgk.swap_attention(make(), "softmax")
    assert "\n" not in str(err.value)


def test_a_parametrized_projection_is_carried_as_its_effective_weight():
    """torch.nn.utils.parametrize (weight norm, orthogonal, ...) keeps the original under ``parametrizations``: the
    weight the layer applies is the attribute, and that is what is carried (the swap to softmax stays exact)."""
    from torch.nn.utils import parametrizations

    torch.manual_seed(0)
    old = nn.MultiheadAttention(E, H, batch_first=True)
    parametrizations.weight_norm(old.out_proj)
    x = torch.randn(2, 5, E)
    with torch.no_grad():
        want = old(x, x, x, need_weights=False)[0]
        new = mgk.swap_attention(old, "softmax")
        torch.testing.assert_close(new(x, need_weights=False)[0], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", ["softmax", "mgk", "gqa", "mlk"])
def test_a_frozen_layer_stays_frozen_and_a_trainable_one_trainable(kind):
    """A swap kept the weights but set requires_grad on every new parameter: a frozen layer of a model being
    fine-tuned would have been trained without a word."""
    frozen = nn.MultiheadAttention(E, H, batch_first=True).eval().requires_grad_(False)
    model = mgk.swap_attention(nn.Sequential(frozen, nn.MultiheadAttention(E, H, batch_first=True)), kind)
    assert not any(p.requires_grad for p in model[0].parameters())
    assert all(p.requires_grad for p in model[1].parameters())


def test_bad_kind_options_and_head_counts_are_refused():
    old = nn.MultiheadAttention(E, H)
    with pytest.raises(ValueError, match="unknown attention kind 'mgkk'"):
        mgk.swap_attention(old, "mgkk")
    with pytest.raises(ValueError, match="'sigma2' does not apply to attention kind 'mlk'"):
        mgk.swap_attention(old, "mlk", sigma2=1.0)
    with pytest.raises(ValueError, match="num_heads=3 does not divide the attention width 16 of MultiheadAttention"):
        mgk.swap_attention(old, "mgk", num_heads=3, heads="slice")
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        mgk.swap_attention(old, "mgk", num_heads=0)
