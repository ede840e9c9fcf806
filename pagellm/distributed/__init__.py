"""Scale-out across processes over ``torch.distributed``."""
