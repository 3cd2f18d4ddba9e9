"""dflashctl: train DFlash drafters on GPU hosts you run yourself."""

__version__ = "0.1.0"
