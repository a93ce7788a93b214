"""Varlen attention kernels and packed-sequence metadata."""
