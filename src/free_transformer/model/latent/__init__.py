"""The latent Z of the Free Transformer. `space.LatentSpace` owns its form (value type, prior draw,
posterior sample with its KL, map to the residual R); the kinds registered by name: the binary ones
(`binary.BinaryLatentSpace`: `binary_mapper`, the paper's, and `bit_linear`), `gaussian` and
`categorical`. `draws` holds the draws and the closed-form KL of bits; `sources` the resolved sources
the model's forward takes; `policy.LatentPolicy` a learned prior or policy over Z;
`plan.LatentPlan` the Z of each position, handed out call by call. Each kind's
module declares its settings beside its class (`settings_type`); nothing here imports `model.config`, which
asks this registry for a kind's settings. The module that holds them together in a model, `LatentPath`, is
`free_transformer.model.latent_path`."""

from .binary import BinaryLatentSpace
from .binary_mapper import BinaryMapper, binary_mapper_project, project_latents
from .bit_linear import BitLinear
from .categorical import CategoricalLatent, CategoricalSettings
from .draws import (
    Generators,
    at_least_float32,
    bits_to_index,
    code_log_probabilities,
    counter_policy_noise,
    counter_policy_words,
    fill_rows_,
    free_bits_kl,
    index_to_bits,
    kl_per_bit,
    kl_to_uniform,
    rand_rows,
    sample_bit_values,
    sample_bits,
)
from .gaussian import GaussianLatent
from .plan import LatentPlan
from .policy import LatentPolicy
from .sources import LatentSource, PolicyDraw
from .space import (
    LATENT_KINDS,
    LatentSpace,
    LinearMap,
    build_latent_space,
    latent_kind,
    normal_init_,
    register_latent_kind,
    with_first_entry,
)

__all__ = [
    "LATENT_KINDS",
    "BinaryLatentSpace",
    "BinaryMapper",
    "BitLinear",
    "CategoricalLatent",
    "CategoricalSettings",
    "GaussianLatent",
    "Generators",
    "LatentPlan",
    "LatentPolicy",
    "LatentSource",
    "LatentSpace",
    "LinearMap",
    "PolicyDraw",
    "at_least_float32",
    "binary_mapper_project",
    "bits_to_index",
    "build_latent_space",
    "code_log_probabilities",
    "counter_policy_noise",
    "counter_policy_words",
    "fill_rows_",
    "free_bits_kl",
    "index_to_bits",
    "kl_per_bit",
    "kl_to_uniform",
    "latent_kind",
    "normal_init_",
    "project_latents",
    "rand_rows",
    "register_latent_kind",
    "sample_bit_values",
    "sample_bits",
    "with_first_entry",
]
