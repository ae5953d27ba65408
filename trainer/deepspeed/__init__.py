"""A cossd optimizer under DeepSpeed: the binding shared by ZeRO 1/2 and ZeRO-3 (binding.py), ZeRO 1/2 (zero.py), ZeRO-3 (zero3.py)."""
