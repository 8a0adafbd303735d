"""portaserve.framework.engine"""
