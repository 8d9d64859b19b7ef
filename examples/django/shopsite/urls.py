from django.contrib.auth import views as auth
from django.urls import include, path
from orders import views

urlpatterns = [
    path("orders", views.place_order),
    path("orders/<int:order_id>", views.show_order),
    path("accounts/login/", auth.LoginView.as_view()),
    # runlane's console, for signed-in staff users (RUNLANE_APP's runtime)
    path("runlane/", include("runlane.integrations.django.urls")),
]
