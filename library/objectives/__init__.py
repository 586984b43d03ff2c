"""The training objectives several families share, below ``families/`` and ``train/``: what a batch's loss trains
towards (``base.py``), sd-scripts' DDPM objective (``ddpm.py``), its noise, timesteps and targets (``noise.py``) and
the loss math with its weightings (``loss.py``); the rectified-flow math of the flow-matching families
(``flow_matching.py``: timestep sampling, the shifted scheduler table, the noisy input, loss weighting). This file
imports nothing, so that a module of the package can import a sibling without running the whole package first."""
