"""make gpu-check"""
