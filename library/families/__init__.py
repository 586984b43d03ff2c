"""Model families (SD 1.x/2.x, SDXL, FLUX.1; the list is ``registry.py``): one package per family with its record
(``spec.FamilySpec``) and its behaviour (``base.ModelFamily``), plus what acts on the whole model: loading
(``model_setup.py``), the precision policy and fp8 storage."""
