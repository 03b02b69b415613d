"""Recipes: which GGML type each GGUF tensor of a conversion gets, as a small strict TOML file.

A recipe file (UTF-8 TOML, read with ``tomllib``)::

    name = "deepseek-v4-flash-iq2xxs"              # required: a short identifier (shipped files are <name>.toml)
    architectures = ["deepseek_v4"]                # required: the config ``model_type``s it applies to
    description = "routed gate/up IQ2_XXS, ..."    # optional
    dialect = "ds4"                                # optional: GGUF dialect convert writes unless told otherwise
                                                   # ("llama.cpp", the default, or "ds4": quantkit.arch.dialects)
    skip = ["mtp"]                                 # optional: tensor classes (or groups) not written at all

    [defaults]
    type = "Q8_0"                                  # optional: the type of every tensor no rule claims
    fallback = "BF16"                              # optional: for rows ``type`` cannot take

    [[rule]]
    class = "routed_experts"                       # required: a tensor class or class group (quantkit.arch)
    layers = "37-42"                               # optional: "A-B" (inclusive), "N", N, or a list of those
    name = 'blk\\.\\d+\\.ffn_down_exps\\.weight'      # optional: regex on the GGUF tensor name, ANCHORED
    type = "Q4_K"                                  # required: a GGML type name, or "source" (below)
    fallback = "Q5_0"                              # optional: type for rows ``type`` cannot take
    tag = "Experts"                                # optional: label of this rule in the name tag ("" = none)

Unknown keys anywhere are errors, as are wrong value types, unknown classes, types and architectures, regexes
that do not compile, and a rule that repeats another's selector (class, layers, name).  Every error is a
:class:`~quantkit.errors.RecipeError` naming the file, the key (``rule[3].type``) and, where the table header
can be found in the text, its line.

Which rule a tensor gets (:func:`resolve`), in this order:

1. **Skip.**  A tensor whose class is listed in ``skip`` (directly or through a group) is not written.
2. **Candidates.**  A rule *selects* a tensor when the tensor's class is the rule's class or belongs to its group,
   the tensor's block index is in ``layers`` (a tensor without a block index, such as ``output.weight``, never
   matches a rule with ``layers``) and ``name`` matches the WHOLE GGUF name (``re.fullmatch``: ``attn_.*`` matches
   neither ``blk.0.attn_q.weight`` nor ``blk.0.hc_attn_fn.weight``; write ``blk\\.\\d+\\.attn_.*``).
   *Protected* tensors (step 4) are only reached by rules that name them specifically: tensors protected by
   their class by rules of that class (no class group contains a protected class), tensors protected by their
   shape only by rules that also give a ``name``; integer tables by no rule.
3. **Precedence.**  Among the candidates the most specific rule wins.  Specificity compares, in order:
   has ``name`` > has ``layers`` > ``class`` is a single class rather than a group.  (So a ranged group rule
   beats an unranged single-class rule, and any named rule beats both.)  Two candidates of the same
   specificity that choose different types or fallbacks are a *tie*: an error naming both rules and the tensor.
4. **Protected defaults** (when no rule reaches the tensor):

   ======================================================  =================================================
   tensor                                                  type
   ======================================================  =================================================
   integer tables (``hash_routing``)                       I32 -- no rule may change them (an error)
   classes router, norm, bias, ssm_param, sinks, conv,     F32 (ape: ggml adds position biases with ops that
   ape                                                     take no BF16 operand on CPU)
   any 1-D tensor                                          F32
   classes hc, indexer (2-D and up)                        the source precision: F32/F16/BF16 as stored,
                                                           F32 for any other source encoding (FP8, ...)
   F32 sources of at most ``SMALL_F32_ELEMENTS`` values    F32
   ======================================================  =================================================

   Nothing is ever downcast by default: llama.cpp's stock mixes quantize ``hc_*``, ``ape`` and indexer tensors
   and lose ~0.03 nats.  A 1-D tensor only ever takes a float type (a rule giving it a block type is an error).
5. **Default type.**  Any other tensor takes ``[defaults] type``; with no default type it is *unclaimed*: an
   error listing every unclaimed tensor (add a rule, a default type, or skip its class).

Row lengths.  A type takes a tensor only when its row length (last numpy dimension) is a multiple of the type's
block size.  Otherwise the rule's ``fallback`` is used (and recorded as such); a rule without a fallback is an
error naming the tensor, the row length and the rule -- never a silent fallback.

``type = "source"`` keeps the source encoding where GGUF holds it losslessly (:data:`LOSSLESS`): F32/F16/BF16
are written as the same type (``copy``: same values, e.g. the Qwen n-gram table byte-exact in BF16), packed FP4
with E8M0 scales per 32 becomes MXFP4 (``mxfp4-repack``: nibble permutation, scale bytes copied), NVFP4 becomes
GGUF NVFP4 (``nvfp4-repack``) plus an F32 ``<name>.scale`` tensor holding the global scale (per expert for
stacked experts).  A source with no lossless path (FP8, F64, mixed encodings), a transform on the way (any, for
packed FP4 sources; a value-changing one, ``plus_one`` or ``neg_exp``, for float sources), or an NVFP4 tensor
llama.cpp loads no ``.scale`` for is an error; a row the lossless type cannot take uses the fallback.

Name tags (:func:`name_tag`), the part of a published file name that says what the recipe does, e.g.
``IQ2XXS-w2Q2K-AProjQ8-SExpQ8-OutQ8``: fragments joined by ``-``.  Types are abbreviated by dropping ``_`` and a
trailing ``_0`` (``Q8_0`` -> ``Q8``, ``Q4_K`` -> ``Q4K``, ``IQ2_XXS`` -> ``IQ2XXS``; ``source`` -> ``Native``).

1. Routed experts (rules of a routed class or group without ``name`` or ``tag``).  With no such rule the tag
   starts with the default type (``Q8``).  Otherwise, for every distinct ``layers`` value of these rules, in
   order of first layer: ``Layers<layers><experts>``, then for the other layers ``<experts>``, prefixed
   ``OtherExpertLayers`` when ranged fragments precede it.  ``<experts>`` describes the gate/up/down types that
   the most specific unnamed rule covering those layers (or all layers) gives each, else the default type:
   ``<T>Experts`` when all three agree; otherwise ``<G>-w2<D>`` (gate/up type, then the down type
   after DeepSeek's name for the down projection, ``w2``) in a tag without ranged fragments, and
   ``<G>GateUp-<D>Down`` beside them (in a ranged fragment each part carries the range:
   ``Layers1Q4KGateUp-Layers1Q2KDown``, since a part without one claims every layer); ``<G>Gate-<U>Up-...``
   if gate and up differ.
2. Every other rule in file order: ``[Layers<layers>]<label><T>``, where the label is the rule's ``tag`` or
   the class's label (:data:`CLASS_LABELS`: ``attn_proj`` -> ``AProj``, ``shared_expert`` -> ``SExp``,
   ``output`` -> ``Out``, ...).  Rules keeping a float type (F32, F16, BF16) or the source encoding, and rules
   with ``tag = ""``, add nothing.  A ``tag`` must be a word file names read as a label (a capital letter, then
   letters) and not another class's label (``tag = "Out"`` on an attention rule would claim its type for the
   output head): :func:`quantkit.names.tag_problem`.

Shipped recipes live in ``quantkit/recipes/shipped/<name>.toml``; :func:`shipped_recipes` lists them and
:func:`load_recipe` takes a path or a shipped name.
"""
from .catalog import SHIPPED_DIR, load_recipe, shipped_recipes
from .model import Defaults, Recipe, Rule, parse_recipe
from .resolve import (KEEP_F32_CLASSES, KEEP_SOURCE_CLASSES, LOSSLESS, SMALL_F32_ELEMENTS, Choice, Resolution,
                      resolve)
from .tags import CLASS_LABELS, name_tag, type_abbreviation

__all__ = ["CLASS_LABELS", "Choice", "Defaults", "KEEP_F32_CLASSES", "KEEP_SOURCE_CLASSES", "LOSSLESS", "Recipe",
           "Resolution", "Rule", "SHIPPED_DIR", "SMALL_F32_ELEMENTS", "load_recipe", "name_tag", "parse_recipe",
           "resolve", "shipped_recipes", "type_abbreviation"]
