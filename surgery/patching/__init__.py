"""The patching mechanics: which classes a spec names on a live model (``registry``), swapping a
forward in and restoring exactly what was there (``swap``), recognising forwards another library
installed (``foreign``), taking transformers' argument names (``signature``), the loss-only patch
of an unsupported causal LM (``fallback``) and the experts implementation's install
(``experts_install``)."""
