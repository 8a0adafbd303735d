"""portaserve.framework.server"""
