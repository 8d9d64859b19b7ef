from django.db import models


class Stock(models.Model):
    item = models.CharField(max_length=100, primary_key=True)
    available = models.PositiveIntegerField()


class Order(models.Model):
    item = models.ForeignKey(Stock, on_delete=models.PROTECT)
    quantity = models.PositiveIntegerField()
    status = models.CharField(max_length=20, default="pending")
    run_id = models.UUIDField(null=True)
