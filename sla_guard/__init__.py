"""sla_guard"""
