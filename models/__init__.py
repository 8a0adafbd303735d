"""portaserve.models"""
