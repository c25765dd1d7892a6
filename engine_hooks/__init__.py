"""engine_hooks"""
