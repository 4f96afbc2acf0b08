"""surgery.models"""
