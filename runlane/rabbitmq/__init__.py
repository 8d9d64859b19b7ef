"""The RabbitMQ transport lane (``pip install 'runlane[rabbitmq]'``)."""

from runlane.rabbitmq._consumer import ConsumerStats
from runlane.rabbitmq._health import RabbitMQStatus
from runlane.rabbitmq._lane import RabbitMQLane, rabbitmq_lane
from runlane.rabbitmq._records import PublisherStats

__all__ = ["ConsumerStats", "PublisherStats", "RabbitMQLane", "RabbitMQStatus", "rabbitmq_lane"]
