"""Model families (SD 1.x/2.x, SDXL): one package per family behind one protocol, plus precision and fp8 storage."""
