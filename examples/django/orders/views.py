"""POST /orders places an order and triggers its fulfilment in the same transaction; GET
/orders/<id> shows it with its run's status."""

from __future__ import annotations

import json

from django.db import transaction
from django.db.models import F
from django.http import HttpRequest, JsonResponse
from django.views.decorators.csrf import csrf_exempt
from django.views.decorators.http import require_GET, require_POST

from orders.models import Order, Stock
from orders.runlane_app import django_connection, fulfil_order, runlane
from runlane import RunNotFound


class OutOfStock(Exception):
    pass


@csrf_exempt
@require_POST
def place_order(request: HttpRequest) -> JsonResponse:
    body = json.loads(request.body)
    try:
        with transaction.atomic():
            order = Order.objects.create(item_id=body["item"], quantity=body["quantity"])
            # the run is written in this transaction, on Django's own connection
            handle = runlane.trigger(
                fulfil_order, {"order_id": order.pk}, connection=django_connection()
            )
            order.run_id = handle.id
            order.save(update_fields=["run_id"])
            reserved = Stock.objects.filter(
                item=body["item"], available__gte=body["quantity"]
            ).update(available=F("available") - body["quantity"])
            if not reserved:
                raise OutOfStock(body["item"])  # rolls back the order and its run
    except OutOfStock:
        return JsonResponse({"error": f"not enough {body['item']} in stock"}, status=409)
    return JsonResponse({"order_id": order.pk, "run_id": str(handle.id)}, status=202)


@require_GET
def show_order(request: HttpRequest, order_id: int) -> JsonResponse:
    order = Order.objects.filter(pk=order_id).first()
    if order is None:
        return JsonResponse({"error": "no such order"}, status=404)
    try:
        run_status = runlane.get_run(order.run_id).status.value if order.run_id else None
    except RunNotFound:  # pruned by retention
        run_status = None
    return JsonResponse(
        {"id": order.pk, "status": order.status, "run_status": run_status}, status=200
    )
