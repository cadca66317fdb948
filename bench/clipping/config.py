"""The benchmark's names and numbers: methods and method sets, default models, the speed and
memory targets, and the tag of the lines a child process sends to its parent."""
from __future__ import annotations

FROZEN = "_frozen"  # suffix: the method with the --frozen-set parameters frozen
#: private_engine's clipping modes, each a method of the same name (two-pass, then
#: single-backward book-keeping)
OUR_MODES = ("mixed", "ghost", "per_sample", "bk", "bk_mixed", "bk_mixopt")
OPACUS = ("opacus_hooks", "opacus_ghost")
DROPIN = ("dropin_hooks", "dropin_ghost")
METHODS = (("nondp",) + OUR_MODES + OPACUS + DROPIN
           + ("mixed" + FROZEN, "bk_mixed" + FROZEN, "opacus_hooks" + FROZEN,
              "opacus_ghost" + FROZEN, "dropin_hooks" + FROZEN, "dropin_ghost" + FROZEN))
#: our methods (compared with non-DP training and Opacus, checked against the targets)
OURS = OUR_MODES + DROPIN + ("mixed" + FROZEN, "bk_mixed" + FROZEN, "dropin_hooks" + FROZEN,
                             "dropin_ghost" + FROZEN)
#: --methods core: every method that trains all parameters through a native API
CORE_METHODS = ("nondp",) + OUR_MODES + OPACUS
#: --methods shortcuts
METHOD_SETS = {"all": METHODS, "core": CORE_METHODS}
#: --methods default per device
DEFAULT_METHODS = {"cpu": CORE_METHODS, "cuda": CORE_METHODS}
#: parameters timm ViTs own directly (no layer around them): frozen in the ``*_frozen`` methods
TOKEN_PARAMS = ("cls_token", "pos_embed", "reg_token", "dist_token")
#: the small text model built by this benchmark (not timm/torchvision), and its shape
TEXT_MODEL = "text_transformer"
TEXT_VOCAB, TEXT_DIM, TEXT_DEPTH, TEXT_HEADS = 8192, 256, 4, 4
#: models built from torchvision although timm has the same name (torchvision's VGG-11 has no
#: BatchNorm)
TORCHVISION_MODELS = ("vgg11",)
CUDA_MODELS = ["vit_tiny_patch16_224", "vit_small_patch16_224", "vit_base_patch16_224",
               "resnet18", "resnet50", "vgg11", TEXT_MODEL]
#: --models default
DEFAULT_MODELS = {"cpu": ["vit_tiny_patch16_224"], "cuda": CUDA_MODELS}
#: the speed targets for private_engine: seconds per step ≤ TIME × non-DP (set for ViT-Tiny,
#: batch 16, on CPU; checked on CUDA too); on CUDA peak memory ≤ MEMORY × non-DP and maximum
#: batch ≥ MAX_BATCH × non-DP's
TIME_TARGET_RATIO = 1.15
MEMORY_TARGET_RATIO = 1.10
MAX_BATCH_TARGET_RATIO = 0.9
AMP_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}
SAMPLE_SIZE = 50_000  # only enters the accountant's sampling rate; irrelevant to speed and memory
RESULT_TAG = "@@bench-result@@ "
SKIPPED = "skipped:"  # error text of a method not run because it would repeat another
MIB = 2 ** 20
