"""Importance matrices: llama.cpp's GGUF imatrix and legacy ``.dat`` formats, merging, coverage, the weight-energy
bootstrap for what calibration never observed, the provenance guard, and collection on a transformers model.

=========================  ===========================================================================
:mod:`.model`              :class:`Imatrix`, :class:`Entry`, :class:`Coverage`; ``importance``, ``check_against``,
                           ``conform``
:mod:`.formats`            :func:`load_imatrix` (either format, by content), :func:`save_imatrix`
:mod:`.merge`              :func:`merge_imatrices` (count-weighted, as ``llama-imatrix --in-file``)
:mod:`.bootstrap`          :func:`bootstrap_importance` and the keys that record its use
:mod:`.provenance`         synthetic marks and :func:`require_release_imatrix`
:mod:`.names`              Hugging Face names -> GGUF names through the architecture maps
:mod:`.report`             ``quantkit imatrix info``
:mod:`.collect`            ``quantkit imatrix collect`` (imports torch and transformers when called)
=========================  ===========================================================================

Errors: malformed files and values are :class:`~quantkit.errors.FormatError` (truncation
:class:`~quantkit.errors.TruncatedFileError`); an imatrix that does not fit a model, or a synthetic one offered for a
release, is :class:`~quantkit.errors.ValidationError`.
"""
from .bootstrap import bootstrap_importance
from .formats import load_imatrix, save_imatrix
from .merge import merge_imatrices
from .model import Coverage, Entry, Imatrix, TensorCoverage, make_imatrix
from .provenance import require_release_imatrix

__all__ = ["Coverage", "Entry", "Imatrix", "TensorCoverage", "bootstrap_importance", "load_imatrix", "make_imatrix",
           "merge_imatrices", "require_release_imatrix", "save_imatrix"]
