"""`FreeTransformerForCausalLM`: our `FreeTransformer` behind Hugging Face's `PreTrainedModel` and
`GenerationMixin` interfaces.

The model is composed, not copied: `self.model` is a `free_transformer.FreeTransformer`, so the state
dict is ours under the prefix "model." (`model.layers.0.self_attn.qkv_proj.weight`,
`model.latent.encoder.0...`, `model.latent.mapper.weight`). Hugging Face's cache (a `DynamicCache` by
default) reaches our attention through `HFCacheView`, which presents it with our `KVCache` interface;
model.py knows nothing of it.
"""

from __future__ import annotations

import contextlib
import json
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors import safe_open
from torch import Tensor
from transformers import Cache, DynamicCache, GenerationMixin, LogitsProcessorList, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.utils import cached_file
from transformers.utils import logging as hf_logging

from ..base.counter_random import row_keys
from ..base.fileio import regular_file
from ..base.latent_choice import LatentChoice
from ..base.seeding import generators as seeded_generators
from ..inference.latents import LatentPlan, forward_source, parse_latents, plan_latents
from ..inference.params import Sampling, spelt_fields
from ..inference.seeds import row_seeds
from ..model.loss import IGNORE_INDEX
from ..model.transformer import FreeTransformer
from ..runs.memory import build_model
from ..runs.migrations import fused_name, legacy_latent_key_mapping, upgrade_state_dict
from .configuration import FreeTransformerConfig
from .generation import RowSeededSampler

# transformers 5.24 renamed the KV cache from `past_key_values` to `cache`, both as generate's argument to
# forward and as the output's field. Forward accepts either name; the output fills the installed release's.
CACHE_FIELD = "cache" if "cache" in CausalLMOutputWithPast.__dataclass_fields__ else "past_key_values"

# The latent path's older tensor names (runs.migrations.LEGACY_LATENT_NAMES) as from_pretrained's key_mapping.
LEGACY_KEY_MAPPING = legacy_latent_key_mapping("model.")

# Hugging Face's library defaults for the generation settings read here (GenerationConfig leaves them
# unset and fills these in when generate runs); a setting not listed defaults to None (unset).
HF_GENERATION_DEFAULTS = {
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "num_beams": 1,
    "num_return_sequences": 1,
    "max_length": 20,
    "max_new_tokens": None,
}


# Sampling's fields that choose a token (all but the length), as Hugging Face's generate() names them
SAMPLING_RULE = {name: hf for name, hf in spelt_fields(Sampling, "hf").items() if name != "max_new_tokens"}


class HFCacheView:
    """A Hugging Face `Cache` seen through our `KVCache` interface: `layers.Attention` calls
    `update(layer, start, k, v)` and casts k, v to `keys.dtype` / `values.dtype` before storing; the
    model sets `length` after each call. Hugging Face caches append, so `start` must
    equal the number of positions already cached, and the cache must give back exactly the positions
    seen (a DynamicCache does; static and sliding-window caches do not and are refused)."""

    def __init__(self, cache: Cache, dtype: torch.dtype, capacity: int):
        self.cache = cache
        self.capacity = capacity  # the model's max_seq_len: a DynamicCache grows
        self.keys = self.values = torch.empty(0, dtype=dtype)  # only their dtype is read
        self.length = cache.get_seq_length()

    def update(self, layer: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        cached = self.cache.get_seq_length(layer)
        if cached != start:
            raise ValueError(f"layer {layer}: the cache holds {cached} positions but the input starts at {start}")
        keys, values = self.cache.update(k, v, layer)
        if keys.shape[2] != start + k.shape[2]:  # a static or sliding-window cache: padded or truncated
            raise ValueError(
                f"{type(self.cache).__name__} returned {keys.shape[2]} positions for "
                f"{start + k.shape[2]}: only caches that hold exactly the positions seen "
                "(DynamicCache) are supported"
            )
        return keys, values


@dataclass
class FreeTransformerCausalLMOutput(CausalLMOutputWithPast):
    """Hugging Face's causal-LM output plus the loss's parts and the Z used (see `ModelOutput` in model.py)."""

    cross_entropy_nats: Tensor | None = None
    kl_nats: Tensor | None = None
    latents: Tensor | None = None


class FreeTransformerPreTrainedModel(PreTrainedModel):
    config_class = FreeTransformerConfig
    config: FreeTransformerConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _skip_keys_device_placement = [CACHE_FIELD]

    def _init_weights(self, module) -> None:
        """Our own scheme (FreeTransformer.init_weights) for every tensor, and nothing from Hugging Face's
        generic one. from_pretrained runs this after loading: the guarded init functions then skip the
        loaded tensors, initialise missing ones, and the RoPE tables (not checkpointed) are recomputed."""
        if isinstance(module, FreeTransformer):
            module.init_weights(keep=lambda param: getattr(param, "_is_hf_initialized", False))


HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


def _separate_projections(name_or_path, kwargs) -> dict[str, list[str]]:
    """{safetensors file: its tensor names that are separate q/k/v or gate/up weights} of an export
    (none for one written with the fused projections, or loaded from anything but safetensors)."""
    if name_or_path is None or kwargs.get("gguf_file") or kwargs.get("state_dict") is not None:
        return {}
    hub = {key: kwargs[key] for key in HUB_KWARGS if kwargs.get(key) is not None}

    def found(file):
        local = os.path.join(name_or_path, hub.get("subfolder", ""), file)
        if os.path.lexists(local):  # a FIFO there, which cached_file passes over, would block the loading forever
            regular_file(local)
        return cached_file(
            name_or_path,
            file,
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
            **hub,
        )

    index = found("model.safetensors.index.json")
    if index is not None:
        with open(index) as handle:
            files = [found(shard) for shard in sorted(set(json.load(handle)["weight_map"].values()))]
    else:
        files = [found("model.safetensors")]
    separate = {}
    for path in files:
        if path is None:
            continue
        with safe_open(path, framework="pt") as handle:
            names = [name for name in handle.keys() if fused_name(name) is not None]  # noqa: SIM118  # not iterable
        if names:
            separate[path] = names
    return separate


def _check_weights_described(source, config: FreeTransformerConfig, info: dict) -> None:
    """A one-line ValueError when from_pretrained's config names tensors that the weights lack, or the weights
    hold tensors it has no place for (Hugging Face would initialise the first at random, drop the others)."""
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if not missing and not unexpected:
        return
    problems = [f"the weights lack {name}" for name in missing[:2]]
    problems += [f"the weights hold {name}, which the config has no place for" for name in unexpected[:2]]
    more = len(missing) + len(unexpected) - len(problems)
    raise ValueError(
        f"{source}: config.json does not describe the weights (num_hidden_layers {config.num_hidden_layers}, "
        f"latent_units {config.latent_units}): {'; '.join(problems)}" + (f" (and {more} more)" if more else "")
    )


@contextlib.contextmanager
def _quiet_transformers():
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _rows_per_sequence(n: int, B: int, *values) -> list:
    """`values` with each (B, ...) tensor's rows repeated n times in place (row b becomes rows b n ... b n + n - 1),
    as Hugging Face orders num_return_sequences; anything else (a (1, ...) tensor shared by every row, a name, None)
    as it is."""
    return [
        value.repeat_interleave(n, 0) if isinstance(value, Tensor) and value.shape[:1] == (B,) else value
        for value in values
    ]


class FreeTransformerForCausalLM(FreeTransformerPreTrainedModel, GenerationMixin):
    def __init__(self, config: FreeTransformerConfig):
        super().__init__(config)
        self.model = build_model(config.to_model_config())  # an export's sizes: one line if they cannot fit
        self.post_init()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, **kwargs):
        """Hugging Face's from_pretrained; exports with the latent path's older tensor names
        (LEGACY_KEY_MAPPING) load too, renamed on the way in, and so do exports with separate q/k/v and gate/up
        weights: Hugging Face's loading leaves those aside (and initialises the fused projections),
        then they are read from the export's files and concatenated into the fused weights. A config that does
        not describe the weights (a layer more or less than they hold) is a one-line ValueError, where Hugging
        Face would initialise the missing tensors at random and drop the unexpected ones."""
        kwargs.setdefault("key_mapping", LEGACY_KEY_MAPPING)
        separate = _separate_projections(pretrained_model_name_or_path, kwargs)
        wants_info = kwargs.pop("output_loading_info", False)
        # its unused / newly initialised weights are the separate ones, fused below
        with _quiet_transformers() if separate else contextlib.nullcontext():
            # with output_loading_info=True it returns (model, info), which its type (the model) leaves out
            loaded = super().from_pretrained(pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs)
            model, info = typing.cast(tuple[FreeTransformerForCausalLM, dict], loaded)
        weights = {}
        for path, names in separate.items():
            with safe_open(path, framework="pt") as handle:
                weights.update({name.removeprefix("model."): handle.get_tensor(name) for name in names})
        params = dict(model.model.named_parameters())
        fused = {name: tensor for name, tensor in upgrade_state_dict(weights).items() if name in params}
        with torch.no_grad():
            for name, tensor in fused.items():
                params[name].copy_(tensor)

        def handled(name):  # a fused weight made of separate ones, or one of those
            return any(n is not None and n.removeprefix("model.") in fused for n in (name, fused_name(name)))

        for key in ("missing_keys", "unexpected_keys"):
            info[key] = type(info[key])(name for name in info[key] if not handled(name))
        _check_weights_described(pretrained_model_name_or_path, model.config, info)
        return (model, info) if wants_info else model

    @classmethod
    def from_free_transformer(cls, model: FreeTransformer, **config_kwargs) -> FreeTransformerForCausalLM:
        """Wrap a copy of the weights of one of our models (same dtype and device)."""
        config = FreeTransformerConfig.from_model_config(model.config, **config_kwargs)
        # transformers wraps its .to with functools.wraps, which typeshed types as an unbound function
        hf_model = cls(config).to(device=model.rope_cos.device, dtype=model.embed_tokens.weight.dtype)  # type: ignore[call-arg]
        hf_model.model.load_state_dict(model.state_dict())
        return hf_model.eval()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.model.lm_head

    def forward(
        self,
        input_ids: Tensor | None = None,
        attention_mask: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: Tensor | None = None,
        cache: Cache | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | Tensor = 0,
        latents: str | Tensor | None = None,
        generator: torch.Generator | Sequence[torch.Generator] | None = None,
        kappa_nats: float = 0.0,
        latent_plan: LatentPlan | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> FreeTransformerCausalLMOutput | tuple:
        """Logits for the positions of input_ids after those already in the KV cache (`cache`, or
        `past_key_values` as transformers before 5.24 names it).

        latents (Free Transformer only): "encoder", "prior" or (B or 1, T, ...) values, as for our
        `FreeTransformer.forward`; None means the encoder for a sequence starting at position 0 and
        the prior for a continuation of a cache. generator: one, or one per row, for those draws.
        labels: Hugging Face's convention, labels[:, t] is the token at t (shifted here); the loss is
        cross-entropy + the free-bits KL term with threshold kappa_nats, as in our forward.
        latent_plan: set by `generate`, it decides Z per position and records it.
        """
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported: pass input_ids")
        if input_ids is None:
            raise ValueError("input_ids is required")
        if cache is not None and past_key_values is not None:
            raise ValueError("pass the KV cache once, as cache or as past_key_values")
        past_key_values = cache if cache is not None else past_key_values
        T = input_ids.shape[1]
        if use_cache is None:
            use_cache = self.config.use_cache and not self.training
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        start = past_key_values.get_seq_length() if past_key_values is not None else 0
        self._check_mask_and_positions(attention_mask, position_ids, start, T)

        if start == 0:  # decoding steps feed back sampled tokens: checked once, without a sync per step
            self.model.check_tokens(input_ids)
        if latent_plan is not None:
            if latents is not None:
                raise ValueError("pass either latents or latent_plan, not both")
            source, generator = latent_plan.source(start, T, input_ids.device), latent_plan.generators
        else:
            source = forward_source(self.model, latents, input_ids.shape[0], T, start)

        targets = None
        if labels is not None:
            targets = torch.full_like(labels, IGNORE_INDEX)
            targets[:, :-1] = labels[:, 1:]
        view = None
        if past_key_values is not None:
            view = HFCacheView(past_key_values, self.model.embed_tokens.weight.dtype, self.model.config.max_seq_len)
        out = self.model(
            input_ids,
            targets,
            latents=source,
            kappa_nats=kappa_nats,
            generator=generator,
            cache=view,
            start=start,
            return_logits=True,
        )  # the HF output always has logits
        if latent_plan is not None:
            latent_plan.record(start, out.latents)

        logits = out.logits
        if isinstance(logits_to_keep, int):
            logits = logits[:, -logits_to_keep:] if logits_to_keep > 0 else logits
        else:
            logits = logits[:, logits_to_keep]
        output = FreeTransformerCausalLMOutput(
            loss=out.loss,
            logits=logits,
            cross_entropy_nats=out.cross_entropy_nats,
            kl_nats=out.kl_nats,
            latents=out.latents,
            **{CACHE_FIELD: past_key_values if use_cache else None},  # type: ignore[arg-type]  # named by the release
        )
        return output if return_dict is not False else output.to_tuple()

    @staticmethod
    def _check_mask_and_positions(attention_mask, position_ids, start: int, T: int) -> None:
        if attention_mask is not None and attention_mask.dim() == 2 and not bool((attention_mask == 1).all()):
            raise ValueError(
                "padded batches are not supported: the attention_mask must be all ones "
                "(generate from equal-length prompts, or one prompt at a time)"
            )
        if position_ids is not None:
            expected = torch.arange(start, start + T, device=position_ids.device)
            if not bool((position_ids == expected).all()):
                raise ValueError(f"position_ids must be consecutive from the cache length {start}")

    # ---- generation ---------------------------------------------------------------------------

    @torch.no_grad()
    def generate(
        self,
        inputs: Tensor | None = None,
        generation_config=None,
        *,
        latents: str | Tensor | None = None,
        latent_reference: Tensor | None = None,
        latent_seed: int | None = None,
        seeds: Sequence[int] | None = None,
        **kwargs,
    ):
        """Hugging Face's `generate` with the Free Transformer's latent choices as named arguments.

        latents (Free Transformer only):
            None or "encoder"    prompt Z from the encoder's posterior, then one prior draw per new token;
            "prior"              every Z_t, prompt included, from the prior;
            "shared"             one prior sequence for every row: shared_prior_latents(model,
                                 max_position_embeddings, torch.Generator().manual_seed(latent_seed));
            (B or 1, N, ...) tensor  explicit values for positions [0, N), N >= prompt length; prior after.
        latent_reference: (B or 1, T) token ids, T >= prompt length; Z for positions [0, T) sampled from
            the encoder's posterior Q(Z | reference) (`infer_latents`, generator seeded latent_seed).
        latent_seed: seeds the one-off draws of "shared" and latent_reference (global RNG when None).
        seeds: one int per row. Row i's prompt posterior comes from torch.Generator().manual_seed(seeds[i]),
            its prior draws and, with do_sample=True, its token sampling (temperature, top_k, top_p) from the
            counter-based streams of seeds[i] at each position, as `free_transformer.inference.generate` draws
            them, so the outputs equal ours for the same seeds and latents. Without seeds the draws use the
            global RNG (torch.manual_seed), as Hugging Face does.

        With return_dict_in_generate=True the output also has `latents`, (B, positions fed) the Z_t
        used at every position, like `GenerationResult.latents`. Prompts must have equal lengths
        (no padding). num_return_sequences=n with do_sample=True decodes n rows per prompt, each with its own Z
        (the latents chosen); beam search is not supported with latents or seeds, nor n > 1 with seeds.
        """
        prompts = inputs if inputs is not None else kwargs.get("input_ids")
        if not isinstance(prompts, Tensor) or prompts.dim() != 2 or prompts.shape[1] == 0:
            raise ValueError("generate needs input_ids, a non-empty (B, P) tensor of token ids")
        if kwargs.get("inputs_embeds") is not None:
            raise ValueError("inputs_embeds is not supported: pass input_ids")
        B, P = prompts.shape
        device = self.model.rope_cos.device

        def setting(name):
            if kwargs.get(name) is not None:
                return kwargs[name]
            for source in (generation_config, self.generation_config):
                if source is not None and getattr(source, name, None) is not None:
                    return getattr(source, name)
            return HF_GENERATION_DEFAULTS.get(name)

        is_free = self.model.config.is_free
        wants_plan = latents is not None or latent_reference is not None or latent_seed is not None
        if wants_plan and not is_free:
            raise ValueError("latents, latent_reference and latent_seed need a Free Transformer (latent_units > 0)")
        n = setting("num_return_sequences")
        if (is_free or seeds is not None) and (setting("num_beams") != 1 or (n != 1 and seeds is not None)):
            raise ValueError(
                "beam search is not supported with latents or seeds, nor num_return_sequences > 1 with seeds; "
                "repeat the prompt rows instead (one seed each)"
            )
        if is_free and n != 1 and setting("do_sample"):  # n rows a prompt, in the order Hugging Face returns them
            mask = kwargs.get("attention_mask")
            prompts, latents, latent_reference, mask = _rows_per_sequence(
                n, B, prompts, latents, latent_reference, mask
            )
            if mask is not None:
                kwargs["attention_mask"] = mask
            if inputs is not None:
                inputs = prompts
            else:
                kwargs["input_ids"] = prompts
            B, kwargs["num_return_sequences"] = B * n, 1
        max_new = setting("max_new_tokens")
        fed = P + max_new - 1 if max_new is not None else setting("max_length") - 1
        if fed > self.config.max_position_embeddings:
            raise ValueError(
                f"prompt ({P}) + new tokens - 1 = {fed} exceeds max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )

        generators, keys = None, None
        if seeds is not None:  # as the decoding engine: the prompt's posterior with a generator, the rest keyed
            seeds = row_seeds(seeds, B)
            generators = seeded_generators(seeds, device)
            keys = row_keys(torch.tensor(seeds, dtype=torch.int64, device=device))
        plan = self._latent_plan(B, P, latents, latent_reference, latent_seed, generators, keys) if is_free else None
        if plan is not None:
            kwargs["latent_plan"] = plan
        if keys is not None and setting("do_sample"):  # seeds: our sampling rule, from Hugging Face's settings
            rule = {name: setting(hf) for name, hf in SAMPLING_RULE.items()}
            sampling = Sampling(**{**rule, "top_k": rule["top_k"] or None})  # Hugging Face's top_k=0: no filter
            processors = LogitsProcessorList(kwargs.pop("logits_processor", None) or [])
            processors.append(RowSeededSampler(sampling, keys))
            kwargs.update(do_sample=False, logits_processor=processors, **dict.fromkeys(SAMPLING_RULE.values()))
        output = super().generate(inputs, generation_config, **kwargs)
        if plan is not None and not isinstance(output, Tensor):
            output["latents"] = plan.latents(output.sequences.shape[1] - 1)
        return output

    def _latent_plan(self, B, P, latents, reference, latent_seed, generators, keys) -> LatentPlan:
        """The plan of `free_transformer.inference.generate` for generate's latent arguments (latents parsed
        here, once, and resolved by free_transformer.inference.latents); "shared" draws max_position_embeddings Z, as
        many as our `shared_prior_latents(model, max_seq_len)`, so that the same seed gives the same Z."""
        device = self.model.rope_cos.device
        one_off = torch.Generator(device=device).manual_seed(latent_seed) if latent_seed is not None else None
        if reference is not None:
            if latents is not None:
                raise ValueError("pass either latents or latent_reference, not both")
            latents = LatentChoice.REFERENCE
        return plan_latents(
            self.model,
            None if latents is None else parse_latents(latents),
            B,
            P,
            length=self.config.max_position_embeddings,
            reference=reference,
            generator=one_off,
            generators=generators,
            keys=keys,
        )
